"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as a JSON object in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks in a row for parallel calls, possibly after some text.
"""

from __future__ import annotations

from server.openai.parsers.json_calls import parse_call
from server.openai.parsers.marker_blocks import MarkerBlockParser
from server.openai.parsers.types import ToolCall

END = "</tool_call>"


class HermesToolParser(MarkerBlockParser):
    name = "hermes"
    marker = "<tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._searched = 0

    def _start_block(self) -> None:
        self._searched = 0

    def _block_end(self, block: str) -> int | None:
        # Search only what is new, from far enough back to catch a tag split across deltas.
        at = block.find(END, max(0, self._searched - len(END) + 1))
        if at < 0:
            self._searched = len(block)
            return None
        return at + len(END)

    def _decode(self, block: str) -> list[ToolCall] | None:
        # Without its closing tag (the output ended first), the block is the JSON alone.
        call = parse_call(block.removesuffix(END))
        return None if call is None else [call]
