"""What a LoRA adapter may be called, on the command line (--lora-modules) and at run time.

A name is shown back (in /v1/models, in metrics labels, in logs) and looks like a hub id or a
path: a NUL, a newline or a `..` in it could forge a log line, break a label or, wherever a
name is ever resolved to a folder, climb out of it. So a name keeps to a small character set,
with `/` only between parts (as in `org/adapter-v1.2`).
"""

from __future__ import annotations

import re

MAX_LORA_NAME_LENGTH = 256
_PART = re.compile(r"[A-Za-z0-9._:@+-]+")
LORA_NAME_RULE = (
    f"1 to {MAX_LORA_NAME_LENGTH} characters: ASCII letters, digits and . _ - : @ +, with / "
    "only between parts that are not empty, '.' or '..'"
)


def lora_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, in a sentence that says what can; None if it can."""
    parts = name.split("/")
    allowed = (
        0 < len(name) <= MAX_LORA_NAME_LENGTH
        and all(_PART.fullmatch(part) for part in parts)
        and not any(part in (".", "..") for part in parts)
    )
    if allowed:
        return None
    shown = name if len(name) <= 80 else name[:80] + "..."
    return f"LoRA adapter name {shown!r} is not allowed: a name has {LORA_NAME_RULE}"
