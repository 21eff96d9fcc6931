"""The generic format, for models whose chat template has no tool format of its own: the output
is either one JSON object `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or plain
text (the server's grammar allows only these two; see server/openai/chat/generic_tools.py).

The first character that is not whitespace decides: "{" opens the calls object, which is held
until the output ends (a cut or malformed object is then content, as written); anything else is
an answer, streamed as content as it comes.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from server.openai.parsers.tool_parser import ToolCallParser
from server.openai.parsers.types import ToolCall

CALLS_KEY = "tool_calls"


def read_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole calls object, or None when `text` is not one."""
    try:
        value: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {CALLS_KEY}:
        return None
    items = value[CALLS_KEY]
    if not isinstance(items, list) or not items:
        return None
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        call = ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))
        # A small model may write the same call twice in one list; a client would run it twice.
        if call not in calls:
            calls.append(call)
    return calls


class GenericToolParser(ToolCallParser):
    name: ClassVar[str] = "generic"

    def __init__(self) -> None:
        super().__init__()
        self._branch: Literal["undecided", "text", "calls"] = "undecided"
        self._held = ""

    def _feed(self, delta: str) -> None:
        if self._branch == "text":
            self._content(delta)
            return
        self._held += delta
        if self._branch == "calls":
            return
        start = self._held.lstrip()
        if not start:
            return  # only whitespace so far: it does not say which branch this is
        if start.startswith("{"):
            self._branch = "calls"
        else:
            self._branch = "text"
            self._content(self._held)
            self._held = ""

    def _finish(self) -> None:
        calls = read_calls(self._held) if self._branch == "calls" else None
        if calls is None:
            self._content(self._held)
        for call in calls or []:
            self._call(call)
        self._held = ""
