"""JSON shared by the tool-call formats: where a JSON value ends in a stream, and turning a
decoded `{"name": ..., "arguments": {...}}` object into a ToolCall."""

from __future__ import annotations

import json
from typing import Any

from server.openai.parsers.types import ToolCall


def _reject_constant(name: str) -> Any:
    # json.loads accepts NaN and Infinity, which json.dumps writes back as invalid JSON: a client
    # could not parse the arguments we would send.
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """Strict JSON, or ValueError (malformed, NaN/Infinity, too deep, too long a number)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def call_from_json(obj: Any) -> ToolCall | None:
    """The call an object describes, or None when it is not one.

    A call has a non-empty string "name" and an object under "arguments" (Hermes, Mistral) or
    "parameters" (Llama 3); an object without either is ordinary JSON, not a call. The arguments
    are re-serialised as OpenAI sends them, non-ASCII kept as is.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def parse_call(text: str) -> ToolCall | None:
    """The call that `text` (one JSON object, surrounding whitespace allowed) describes."""
    try:
        return call_from_json(loads(text))
    except ValueError:
        return None


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a JSON array of call objects (or of one object); None unless every element
    is a call: a half-understood array stays text rather than losing its other elements."""
    try:
        value = loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class JsonEndScanner:
    """Finds where the JSON object or array at buffer[start] of a growing buffer closes.

    Fed the same buffer again and again as it grows, it scans only the new characters, so a long
    call costs linear time. It counts brackets outside strings and does not validate: json.loads
    judges the text once it is closed.
    """

    def __init__(self, start: int = 0) -> None:
        self._scanned = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, buffer: str) -> int | None:
        """Index just past the closing bracket of the value starting at buffer[start] ("{" or
        "["), or None while it is still open."""
        for i in range(self._scanned, len(buffer)):
            c = buffer[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scanned = i + 1
                    return i + 1
        self._scanned = len(buffer)
        return None
