"""The requests a benchmark sends, as conversations of turns.

Datasets (named as `vllm bench` names them where it has the same one):
- `random`: prompts of random token ids from the model's tokenizer, so a /v1/completions
  prompt is exactly its input length; for chat, the same ids decoded to text;
- `custom`: a JSONL file of `{"prompt": "..."}` lines;
- `multi-turn`: conversations whose every turn re-sends the history (an optional document,
  then each question and the answer the server gave to it) before its new question.

A single-turn request is a conversation of one turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.bench.workload import WorkItem, make_workload

DATASETS = ("random", "custom", "multi-turn")


class DatasetError(ValueError):
    """A dataset that cannot be built from what was given; the message says what to change."""


@dataclass
class Turn:
    prompt: list[int] | str  # token ids (random prompts to /v1/completions) or text
    output_len: int


@dataclass
class Conversation:
    turns: list[Turn]


def from_workload(items: list[WorkItem]) -> list[Conversation]:
    return [Conversation([Turn(item.prompt_ids, item.output_len)]) for item in items]


def load_tokenizer(name: str) -> Any:
    """A Hugging Face tokenizer from a local folder or a Hub id (the local cache when offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"cannot load the tokenizer {name!r} ({exc}); give --tokenizer a local model folder "
            "or a Hub id"
        ) from None


def random_dataset(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    as_text: bool,
) -> list[Conversation]:
    """Random token ids drawn from the tokenizer's base vocabulary (its added special tokens
    lie above it); `as_text`: decoded, for an endpoint that takes text only."""
    items = make_workload(
        num_prompts, input_len, output_len, range_ratio, tokenizer.vocab_size, seed
    )
    if as_text:
        return [Conversation([Turn(tokenizer.decode(i.prompt_ids), i.output_len)]) for i in items]
    return from_workload(items)


def custom_dataset(path: Path, num_prompts: int, output_len: int) -> list[Conversation]:
    """The file's prompts in order, repeated from the top when it has fewer than asked for."""
    prompts: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read --dataset-path {str(path)!r}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DatasetError(f'{path}:{number}: expected {{"prompt": "..."}}, got {line[:80]!r}')
        prompts.append(row["prompt"])
    if not prompts:
        raise DatasetError(f"{path} holds no prompt")
    return [Conversation([Turn(prompts[i % len(prompts)], output_len)]) for i in range(num_prompts)]


def multi_turn_dataset(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int,
    document_len: int,
    same_document: bool,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[Conversation]:
    """Conversations of `num_turns` questions of about `input_len` tokens, each answered in
    `output_len`; the first question follows a document of `document_len` tokens, one for
    each conversation or (`same_document`) one that all conversations share."""
    vocab = tokenizer.vocab_size
    documents = make_workload(
        1 if same_document else num_conversations, document_len, 1, 0.0, vocab, f"doc-{seed}"
    )
    questions = make_workload(
        num_conversations * num_turns, input_len, output_len, range_ratio, vocab, seed
    )
    conversations = []
    for c in range(num_conversations):
        document = tokenizer.decode(documents[0 if same_document else c].prompt_ids)
        turns = []
        for t in range(num_turns):
            question = questions[c * num_turns + t]
            text = tokenizer.decode(question.prompt_ids)
            if t == 0 and document_len > 0:
                text = f"{document}\n\n{text}"
            turns.append(Turn(text, question.output_len))
        conversations.append(Conversation(turns))
    return conversations


def completion_prompt(conversation: Conversation, answers: list[str]) -> list[int] | str:
    """The prompt of the turn after `answers`: for a later turn, the whole history as text."""
    turns = conversation.turns
    if not answers:
        return turns[0].prompt
    pieces: list[str] = []
    for turn, answer in zip(turns, answers):
        pieces += [_text(turn.prompt), answer]
    pieces.append(_text(turns[len(answers)].prompt))
    return "\n".join(pieces)


def chat_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after `answers`: every earlier question and its answer."""
    messages = []
    for turn, answer in zip(conversation.turns, answers):
        messages += [
            {"role": "user", "content": _text(turn.prompt)},
            {"role": "assistant", "content": answer},
        ]
    messages.append({"role": "user", "content": _text(conversation.turns[len(answers)].prompt)})
    return messages


def _text(prompt: list[int] | str) -> str:
    if not isinstance(prompt, str):
        raise DatasetError("a chat or multi-turn request needs text prompts, not token ids")
    return prompt
