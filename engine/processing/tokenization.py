"""Text and conversations to token ids, the same way for the offline API and the server (which
calls these with a tokenizer of its own, off its event loop)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.errors import InvalidRequestError

# transformers 5 skips its space clean-up for BPE tokenizers unless this attribute says otherwise;
# transformers 4 has no such attribute and always cleans up when asked.
_BPE_CLEANUP_FLAG = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def encode_truncated(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> list[int]:
    """At most `max_tokens` tokens, special tokens included: the text's last tokens (vLLM's rule
    for truncate_prompt_tokens, as for token ids) between the special tokens the tokenizer
    wraps it in (BERT's [CLS] ... [SEP])."""
    full = encode(tokenizer, text)
    if len(full) <= max_tokens:
        return full
    content = encode(tokenizer, text, add_special_tokens=False)
    specials = len(full) - len(content)
    start = next((i for i in range(specials + 1) if full[i : i + len(content)] == content), None)
    if start is None or max_tokens <= specials:  # no plain wrapping to keep: the last tokens
        return truncate_ids(full, max_tokens)
    kept = content[len(content) - (max_tokens - specials) :]
    return full[:start] + kept + full[start + len(content) :]


def truncate_ids(token_ids: list[int], max_tokens: int) -> list[int]:
    """Token ids given as they are: the last `max_tokens` (vLLM's rule for token prompts)."""
    return list(token_ids[-max_tokens:]) if len(token_ids) > max_tokens else list(token_ids)


def truncation(truncate_prompt_tokens: int | None, window: int) -> int | None:
    """`truncate_prompt_tokens` as a token count (-1: the model's window); InvalidRequestError
    naming it when out of range."""
    if truncate_prompt_tokens is None:
        return None
    count = window if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if not 1 <= count <= window:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or between 1 and the model's window {window}, "
            f"got {truncate_prompt_tokens}",
            "truncate_prompt_tokens",
        )
    return count


def pooling_tokens(
    tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int], truncate: int | None
) -> list[int]:
    """A pooling input's token ids (a text tokenized with its special tokens), cut to its last
    `truncate` tokens when given (a count from `truncation`)."""
    if isinstance(prompt, str):
        return (
            encode(tokenizer, prompt)
            if truncate is None
            else encode_truncated(tokenizer, prompt, truncate)
        )
    return list(prompt) if truncate is None else truncate_ids(list(prompt), truncate)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`tools` (OpenAI tool definitions) and `template_kwargs` (e.g. Qwen3's enable_thinking)
    are variables of the template."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,  # type: ignore[arg-type]  # dicts are what it takes
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    assert isinstance(text, str)  # tokenize=False renders one conversation to one string
    # The template already holds the special tokens; do not add a second BOS.
    return encode(tokenizer, text, add_special_tokens=False)


def decode(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], skip_special_tokens: bool = False
) -> str:
    # One flat list of ids decodes to one string (a list of lists would give a list of them).
    return cast(str, tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def flat_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """`decode(tokenizer, ids, skip_special_tokens)` for a flat list of ids, as one function.

    Where that decode is the Rust tokenizer's and nothing else (a fast tokenizer that does not
    override its decode, with no space clean-up to apply), the function calls the Rust tokenizer
    directly: transformers' wrapper around it (argument conversion, batch checks) costs several
    times the decode, and a stream decodes twice per token (bench/cpu/host_step.py)."""
    direct = isinstance(tokenizer, PreTrainedTokenizerFast) and (
        type(tokenizer)._decode is PreTrainedTokenizerFast._decode
    )
    if direct and tokenizer.clean_up_tokenization_spaces:
        direct = (
            getattr(tokenizer, _BPE_CLEANUP_FLAG, None) is False
            and type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        )
    if direct:
        rust = tokenizer.backend_tokenizer
        return lambda ids: cast(str, rust.decode(ids, skip_special_tokens=skip_special_tokens))
    return lambda ids: decode(tokenizer, ids, skip_special_tokens)
