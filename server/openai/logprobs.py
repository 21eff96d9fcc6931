"""The engine's logprobs (token id -> logprob per position, the chosen token first) in
OpenAI's two shapes: the completions object and the chat object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.outputs import PositionLogprobs
from server.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def add_completion_logprobs(
    target: CompletionLogprobs,
    tokenizer: Any,
    token_ids: list[int],
    positions: Sequence[PositionLogprobs | None],
    offset: int,
) -> int:
    """Append one entry per token (all of a position's alternatives: the chosen token and the
    top N, as vLLM does); `offset` is where the first token starts in the choice's text.
    Returns the offset after the last token."""
    for token_id, position in zip(token_ids, positions):
        text = token_text(tokenizer, token_id)
        target.tokens.append(text)
        target.text_offset.append(offset)
        offset += len(text)
        if position is None:  # the first prompt token: nothing came before it to predict it
            target.token_logprobs.append(None)
            target.top_logprobs.append(None)
            continue
        target.token_logprobs.append(position[token_id])
        top: dict[str, float] = {}
        for alt_id, logprob in position.items():
            top.setdefault(token_text(tokenizer, alt_id), logprob)
        target.top_logprobs.append(top)
    return offset


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs], top_n: int
) -> list[TokenLogprob]:
    """One entry per token with exactly the `top_n` most likely alternatives, best first."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        chosen = _top(tokenizer, token_id, position[token_id])
        ranked = sorted(position.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        entries.append(
            TokenLogprob(
                **chosen.model_dump(), top_logprobs=[_top(tokenizer, t, lp) for t, lp in ranked]
            )
        )
    return entries
