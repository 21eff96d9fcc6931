"""The streaming tool-call parser every format builds on.

A format only decides which text is a call; this base turns its decisions into OpenAI-shaped
events and applies the rules they share. The whole-output `extract` is the same parser fed the
text in one piece, so the two can never disagree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from server.openai.parsers.types import (
    ContentDelta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolParserEvent,
)


class ToolCallParser(ABC):
    """Feed it text deltas of one output; it returns content and tool-call events.

    Content rule (all formats): the text outside successful calls is content, except stretches
    of only whitespace between, before or after calls (the newlines a model puts around its call
    blocks); with no call at all, the whole text is content. Such whitespace is held back until
    it is known which it is.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._events: list[ToolParserEvent] = []
        self._num_calls = 0
        # Whitespace opening the current stretch of text, held until the stretch shows text or
        # ends at a call (then dropped) or at the end of output.
        self._pending_space = ""
        self._stretch_has_text = False
        self._finished = False

    def feed(self, delta: str) -> list[ToolParserEvent]:
        """The events this delta decides (possibly none: text may be held back)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._feed(delta)
        return self._take_events()

    def finish(self) -> list[ToolParserEvent]:
        """The events of everything still held back, at the end of the output."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._finish()
        if self._pending_space and self._num_calls == 0:
            self._emit_text(self._pending_space)
        self._pending_space = ""
        return self._take_events()

    @classmethod
    def extract(cls, text: str) -> ExtractedToolCalls:
        """Content and calls of a whole output."""
        parser = cls()
        events = parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls: list[ToolCall] = []
        for e in events:
            if isinstance(e, ToolCallStart):
                calls.append(ToolCall(name=e.name, arguments="", id=e.id))
            elif isinstance(e, ToolCallArgumentsDelta):
                last = calls[e.index]
                calls[e.index] = ToolCall(last.name, last.arguments + e.arguments, last.id)
        return ExtractedToolCalls(content=content if content or not calls else None, calls=calls)

    @property
    def num_calls(self) -> int:
        """Calls emitted so far (the next call's index)."""
        return self._num_calls

    # What a format implements.

    @abstractmethod
    def _feed(self, delta: str) -> None:
        """Take in a delta, reporting decided text with _content and calls with _call."""

    @abstractmethod
    def _finish(self) -> None:
        """Decide everything held back: the output has ended."""

    # What a format reports with.

    def _content(self, text: str) -> None:
        """Text decided not to be part of a call."""
        if self._stretch_has_text:
            self._emit_text(text)
            return
        self._pending_space += text
        if self._pending_space and not self._pending_space.isspace():
            self._stretch_has_text = True
            text, self._pending_space = self._pending_space, ""
            self._emit_text(text)

    def _call(self, call: ToolCall) -> None:
        """A call decided whole: its name event, then its arguments in one fragment."""
        # Whitespace between the previous text and this call separated them: drop it.
        self._pending_space = ""
        self._stretch_has_text = False
        index = self._num_calls
        self._num_calls += 1
        self._events.append(ToolCallStart(index=index, id=call.id, name=call.name))
        self._events.append(ToolCallArgumentsDelta(index=index, arguments=call.arguments))

    def _emit_text(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], ContentDelta):
            self._events[-1] = ContentDelta(self._events[-1].text + text)
        else:
            self._events.append(ContentDelta(text))

    def _take_events(self) -> list[ToolParserEvent]:
        events, self._events = self._events, []
        return events
