"""The prompt shapes the offline API takes, as vLLM's does: a text, a list of token ids, or a dict
naming one of them (`{"prompt": text}`, `{"prompt_token_ids": ids}`), which may also carry
images (`"multi_modal_data": {"image": image or [images]}`, PIL images). Each becomes the plain
text or token list the engine reads, so every shape of one prompt gives the same request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired

from engine.errors import InvalidRequestError


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]


PlainPrompt = str | list[int]
PromptType = str | list[int] | TextPrompt | TokensPrompt

SHAPES = "a text, a list of token ids, {'prompt': text} or {'prompt_token_ids': token ids}"


def as_prompt_batch(
    prompts: PromptType | Sequence[PromptType], images: list[list[Any]] | None = None
) -> list[PlainPrompt]:
    """One prompt (any shape) or a sequence of them, as plain prompts in order; a malformed
    prompt is an InvalidRequestError naming its position and the shapes that are taken.
    `images`: where each prompt's images are appended (an empty list for a text prompt);
    without it, a prompt with images is refused."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        batch: list[object] = [prompts]
    else:
        batch = list(prompts)
    plain = []
    for index, prompt in enumerate(batch):
        if images is not None:
            images.append(_images(prompt, index))
        plain.append(_plain(prompt, index, images is not None))
    return plain


def _images(prompt: object, index: int) -> list[Any]:
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or sorted(map(str, data)) != ["image"]:
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise InvalidRequestError(
            f"prompt {index}: multi_modal_data takes {{'image': image or [images]}}; got {got}",
            param="multi_modal_data",
        )
    value = data["image"]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _plain(prompt: object, index: int, with_images: bool = False) -> PlainPrompt:
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt):
        return list(prompt)  # type: ignore[call-overload]
    if not isinstance(prompt, dict):
        raise _malformed(index, f"got {type(prompt).__name__}")
    keys = sorted(str(k) for k in prompt if not (with_images and k == "multi_modal_data"))
    if keys == ["prompt"] and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == ["prompt_token_ids"] and _is_token_ids(prompt["prompt_token_ids"]):
        return list(prompt["prompt_token_ids"])
    if keys in (["prompt"], ["prompt_token_ids"]):
        got = type(prompt[keys[0]]).__name__
        raise _malformed(index, f"'{keys[0]}' holds a {got}")
    # Cache salts and the like are vLLM features this engine does not have (and images where
    # the caller takes none): refused by name rather than silently dropped.
    raise _malformed(index, f"a dict with keys {keys}")


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _malformed(index: int, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"prompt {index}: expected {SHAPES}; {what}", param="prompt")
