"""`mistral`: Mistral models (tokenizer before v11) write `[TOOL_CALLS]` and then all their
calls as one JSON array,

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

possibly after some text. The marker is a special token: the text must be decoded with
skip_special_tokens=False for the parser to see it.
"""

from __future__ import annotations

from server.openai.parsers.json_calls import JsonEndScanner, parse_calls
from server.openai.parsers.marker_blocks import MarkerBlockParser
from server.openai.parsers.types import ToolCall


class MistralToolParser(MarkerBlockParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__()
        self._scanner: JsonEndScanner | None = None

    def _start_block(self) -> None:
        self._scanner = None

    def _block_end(self, block: str) -> int | None:
        if self._scanner is None:
            start = len(block) - len(block.lstrip())
            if start == len(block):
                return None  # only whitespace after the marker so far
            if block[start] not in "[{":
                # Not JSON: the marker and the whitespace after it stay text, and what follows
                # is parsed as text again.
                return start
            self._scanner = JsonEndScanner(start)
        return self._scanner.end(block)

    def _decode(self, block: str) -> list[ToolCall] | None:
        return parse_calls(block)
