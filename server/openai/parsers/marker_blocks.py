"""Formats whose calls are blocks opened by a marker anywhere in the text (Hermes'
`<tool_call>`, Mistral's `[TOOL_CALLS]`): text until a marker, then a block, then text again."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from server.openai.parsers.holdback import partial_marker_len
from server.openai.parsers.tool_parser import ToolCallParser
from server.openai.parsers.types import ToolCall


class MarkerBlockParser(ToolCallParser):
    marker: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # undecided text: a possible partial marker, or the open block
        self._in_block = False

    @abstractmethod
    def _block_end(self, block: str) -> int | None:
        """Where the block that follows the marker ends (its text is block[:end]), or None
        while that is not yet known. The text after it is parsed as text again."""

    @abstractmethod
    def _decode(self, block: str) -> list[ToolCall] | None:
        """The calls in a block's text, or None when it is not well-formed calls."""

    def _feed(self, delta: str) -> None:
        self._buffer += delta
        while self._step():
            pass

    def _step(self) -> bool:
        """Decide what can be decided at the front of the buffer; True if it moved on."""
        if not self._in_block:
            at = self._buffer.find(self.marker)
            if at < 0:
                keep = partial_marker_len(self._buffer, self.marker)
                self._content(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            self._content(self._buffer[:at])
            self._buffer = self._buffer[at + len(self.marker) :]
            self._start_block()
            self._in_block = True
            return True
        end = self._block_end(self._buffer)
        if end is None:
            return False
        self._close_block(self._buffer[:end])
        self._buffer = self._buffer[end:]
        self._in_block = False
        return True

    def _finish(self) -> None:
        if self._in_block:
            # A block the output ended inside (no closing tag, or cut off by max_tokens): calls
            # if what there is parses, text otherwise.
            self._close_block(self._buffer)
        else:
            self._content(self._buffer)  # a partial marker at the very end is text
        self._buffer = ""

    def _start_block(self) -> None:
        """Reset per-block scanning state."""

    def _close_block(self, block: str) -> None:
        calls = self._decode(block)
        if calls is None:
            self._content(self.marker + block)
            return
        for call in calls:
            self._call(call)
