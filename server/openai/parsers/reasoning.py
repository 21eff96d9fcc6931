"""Reasoning parsers: a model's `<think>...</think>` as `reasoning_content`, the rest as content.

Two readings of an output, named as vLLM's parsers:

- `deepseek_r1`: the chat template already put `<think>` in the prompt, so the output is
  reasoning from its first character until `</think>`; without `</think>` it is all reasoning
  (cut off while thinking). Templates that open the think block in the prompt (Qwen3's
  "-Thinking-2507", Qwen3.5) need this reading too.
- `qwen3`: the Qwen3 template leaves `<think>` to the model; an output that does not start with
  it has thinking disabled (`enable_thinking=False` closes an empty block in the prompt) and is
  all content; one that starts with it but never closes it was cut off while thinking and is
  all reasoning. (vLLM's newer `qwen3` instead reads a tagless output as reasoning unless the
  request disabled thinking: that needs the request, and these parsers read text only.)

`<think>` counts only as the very first thing in the output, and is dropped there. Whitespace is
kept as the model wrote it, as vLLM does (Qwen3 writes `<think>\\n...\\n</think>\\n\\n`): the
reasoning, the content and the two tags are the output again.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import ClassVar

from server.openai.parsers.holdback import partial_marker_len
from server.openai.parsers.types import ContentDelta, ReasoningDelta, ReasoningEvent


class _State(Enum):
    START = auto()  # whether the output opens with <think> is not yet known
    REASONING = auto()
    CONTENT = auto()


class ReasoningParser:
    """Feed it the text deltas of one output; it returns reasoning and content events."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether an output that does not open with the start tag is reasoning (until the end tag).
    starts_in_reasoning: ClassVar[bool]

    def __init__(self) -> None:
        self._state = _State.START
        self._buffer = ""  # undecided: a partial start tag, or a partial end tag
        self._events: list[ReasoningEvent] = []
        self._finished = False

    def feed(self, delta: str) -> list[ReasoningEvent]:
        """The events this delta decides (possibly none: a partial tag is held back)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buffer += delta
        while self._step():
            pass
        return self._take_events()

    def finish(self) -> list[ReasoningEvent]:
        """The events of what is still held back, at the end of the output."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if self._state is _State.START:
            # Shorter than the start tag: its beginning only, so no tag.
            self._state = _State.REASONING if self.starts_in_reasoning else _State.CONTENT
        self._emit(self._buffer)
        self._buffer = ""
        return self._take_events()

    @classmethod
    def extract(cls, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        parser = cls()
        events = parser.feed(text) + parser.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return reasoning or None, content or None

    def _step(self) -> bool:
        buf = self._buffer
        if self._state is _State.START:
            if buf.startswith(self.start):
                self._buffer = buf[len(self.start) :]
                self._state = _State.REASONING
                return True
            if self.start.startswith(buf):
                return False  # a beginning of the tag, or nothing yet
            self._state = _State.REASONING if self.starts_in_reasoning else _State.CONTENT
            return True
        if self._state is _State.REASONING:
            at = buf.find(self.end)
            if at >= 0:
                self._emit(buf[:at])
                self._buffer = buf[at + len(self.end) :]
                self._state = _State.CONTENT
                return True
            keep = partial_marker_len(buf, self.end)
            self._emit(buf[: len(buf) - keep])
            self._buffer = buf[len(buf) - keep :]
            return False
        self._emit(buf)
        self._buffer = ""
        return False

    def _emit(self, text: str) -> None:
        if not text:
            return
        kind = ReasoningDelta if self._state is _State.REASONING else ContentDelta
        if self._events and type(self._events[-1]) is kind:
            self._events[-1] = kind(self._events[-1].text + text)
        else:
            self._events.append(kind(text))

    def _take_events(self) -> list[ReasoningEvent]:
        events, self._events = self._events, []
        return events


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
