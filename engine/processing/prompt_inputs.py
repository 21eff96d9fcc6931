"""The prompt shapes the offline API takes, as vLLM's does: a text, a list of token ids, or a dict
naming one of them (`{"prompt": text}`, `{"prompt_token_ids": ids}`). Each becomes the plain
text or token list the engine reads, so every shape of one prompt gives the same request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from engine.errors import InvalidRequestError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PlainPrompt = str | list[int]
PromptType = str | list[int] | TextPrompt | TokensPrompt

SHAPES = "a text, a list of token ids, {'prompt': text} or {'prompt_token_ids': token ids}"


def as_prompt_batch(prompts: PromptType | Sequence[PromptType]) -> list[PlainPrompt]:
    """One prompt (any shape) or a sequence of them, as plain prompts in order; a malformed
    prompt is an InvalidRequestError naming its position and the shapes that are taken."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        batch: list[object] = [prompts]
    else:
        batch = list(prompts)
    return [_plain(prompt, index) for index, prompt in enumerate(batch)]


def _plain(prompt: object, index: int) -> PlainPrompt:
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return list(prompt)  # type: ignore[call-overload]
    if not isinstance(prompt, dict):
        raise _malformed(index, f"got {type(prompt).__name__}")
    keys = sorted(map(str, prompt))
    if keys == ["prompt"] and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == ["prompt_token_ids"] and _is_token_ids(prompt["prompt_token_ids"]):
        return list(prompt["prompt_token_ids"])
    if keys in (["prompt"], ["prompt_token_ids"]):
        got = type(prompt[keys[0]]).__name__
        raise _malformed(index, f"'{keys[0]}' holds a {got}")
    # Multimodal data, cache salts and the like are vLLM features this engine does not have:
    # refused by name rather than silently dropped.
    raise _malformed(index, f"a dict with keys {keys}")


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _malformed(index: int, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"prompt {index}: expected {SHAPES}; {what}", param="prompt")
