"""`llama3_json`: Llama 3.1/3.2/3.3 with JSON tool calling answer with the call itself, a JSON
object and nothing else,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (a special token: only seen when decoding keeps special
tokens), several calls separated by ";". Only output that starts that way holds calls: an
answer in prose that shows some JSON is content. Calls are read one after another; text after
the last one (or from the first object that is not a call) is content.
"""

from __future__ import annotations

from enum import Enum, auto

from server.openai.parsers.json_calls import JsonEndScanner, parse_call
from server.openai.parsers.tool_parser import ToolCallParser

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    START = auto()  # before anything but whitespace and (part of) the python tag
    EXPECT_OBJECT = auto()  # after the tag or a ";": whitespace, then "{"
    OBJECT = auto()  # inside a JSON object
    AFTER_CALL = auto()  # after a call: whitespace, then ";" or the end
    TEXT = auto()  # the rest of the output is content


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._state = _State.START
        # Text since the last call (tag, separators, whitespace, the open object): dropped when
        # the next call parses, content when it does not.
        self._buffer = ""
        self._pos = 0  # where in the buffer to look next
        self._object_start = 0
        self._scanner = JsonEndScanner()

    def _feed(self, delta: str) -> None:
        if self._state is _State.TEXT:
            self._content(delta)
            return
        self._buffer += delta
        while self._step():
            pass

    def _step(self) -> bool:
        """Decide what the buffer allows; True if the state moved on."""
        buf = self._buffer
        if self._state is _State.START:
            lead = buf.lstrip()
            if lead.startswith(PYTHON_TAG):
                return self._expect(_State.EXPECT_OBJECT, len(buf) - len(lead) + len(PYTHON_TAG))
            if lead.startswith("{"):
                return self._expect(_State.EXPECT_OBJECT, len(buf) - len(lead))
            if PYTHON_TAG.startswith(lead):
                return False  # only whitespace or part of the tag so far
            return self._to_text()
        if self._state is _State.OBJECT:
            end = self._scanner.end(buf)
            if end is None:
                return False
            call = parse_call(buf[self._object_start : end])
            if call is None:
                return self._to_text()
            self._call(call)
            self._buffer = buf[end:]
            return self._expect(_State.AFTER_CALL, 0)
        if self._state in (_State.EXPECT_OBJECT, _State.AFTER_CALL):
            at = self._first_non_space()
            if at is None:
                return False
            if self._state is _State.AFTER_CALL and buf[at] == ";":
                return self._expect(_State.EXPECT_OBJECT, at + 1)
            if self._state is _State.AFTER_CALL or buf[at] != "{":
                return self._to_text()
            self._object_start = at
            self._scanner = JsonEndScanner(at)
            self._state = _State.OBJECT
            return True
        return False

    def _finish(self) -> None:
        # Whatever is undecided at the end (a lone tag, an unclosed object, a trailing ";") is
        # text; whitespace alone after a call is dropped by the content rule.
        self._content(self._buffer)
        self._buffer = ""

    def _expect(self, state: _State, pos: int) -> bool:
        self._state = state
        self._pos = pos
        return True

    def _first_non_space(self) -> int | None:
        for i in range(self._pos, len(self._buffer)):
            if not self._buffer[i].isspace():
                return i
        self._pos = len(self._buffer)  # whitespace so far: look only at what comes next
        return None

    def _to_text(self) -> bool:
        self._state = _State.TEXT
        self._content(self._buffer)
        self._buffer = ""
        return False
