"""Text and conversations to token ids, the same way for the offline API and the server (which
calls these with a tokenizer of its own, off its event loop)."""

from __future__ import annotations

from typing import Any


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    # The template already holds the special tokens; do not add a second BOS.
    return encode(tokenizer, text, add_special_tokens=False)
