"""One chat choice's deltas (server/openai/chat/output.py) as Anthropic content blocks, and the
stream events that build them: a block starts, grows by deltas, stops. Text, reasoning and each
tool call are blocks of their own, in the order the model wrote them."""

from __future__ import annotations

import json
from typing import Any

from engine.outputs import CompletionOutput
from server.anthropic.protocol import (
    BlockDelta,
    BlockStart,
    BlockStop,
    ContentBlock,
    InputJsonDelta,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from server.openai.chat.protocol import Delta


def tool_use_id(call_id: str) -> str:
    """Anthropic's ids for tool uses read `toolu_...`; the chat path's read `call_...`."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is. The parsers and the forced-call
    grammar give a JSON object; anything else (a model that wrote a bare value) is kept whole."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class BlockBuilder:
    """`feed` the deltas of the one choice; each call returns the events it caused. `content`
    holds the blocks so far (a tool use's input is filled in when it stops)."""

    def __init__(self) -> None:
        self.content: list[ContentBlock] = []
        self._open: ContentBlock | None = None
        self._arguments = ""  # the open tool use's JSON so far

    def feed(self, deltas: list[Delta]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for delta in deltas:
            if delta.reasoning_content:
                events += self._grow(ThinkingBlock, delta.reasoning_content)
            if delta.content:
                events += self._grow(TextBlock, delta.content)
            for call in delta.tool_calls or []:
                if call.id is not None:
                    block = ToolUseBlock(
                        id=tool_use_id(call.id), name=call.function.name or "", input={}
                    )
                    events += self._start(block)
                events += self._grow(ToolUseBlock, call.function.arguments)
        return events

    def close(self) -> list[StreamEvent]:
        block = self._open
        if block is None:
            return []
        if isinstance(block, ToolUseBlock):
            block.input = tool_input(self._arguments)
        self._open = None
        return [BlockStop(index=len(self.content) - 1)]

    @property
    def called(self) -> bool:
        return any(isinstance(b, ToolUseBlock) for b in self.content)

    def _start(self, block: ContentBlock) -> list[StreamEvent]:
        events = self.close()
        self.content.append(block)
        self._open, self._arguments = block, ""
        start = BlockStart(index=len(self.content) - 1, content_block=block.model_copy(deep=True))
        return events + [start]

    def _grow(self, kind: type[ContentBlock], text: str) -> list[StreamEvent]:
        if not text:
            return []
        events: list[StreamEvent] = []
        block = self._open
        if not isinstance(block, kind):  # a tool use is started by its call's first delta
            block = TextBlock(text="") if kind is TextBlock else ThinkingBlock(thinking="")
            events += self._start(block)
        index = len(self.content) - 1
        if isinstance(block, TextBlock):
            block.text += text
            events.append(BlockDelta(index=index, delta=TextDelta(text=text)))
        elif isinstance(block, ThinkingBlock):
            block.thinking += text
            events.append(BlockDelta(index=index, delta=ThinkingDelta(thinking=text)))
        else:
            self._arguments += text
            events.append(BlockDelta(index=index, delta=InputJsonDelta(partial_json=text)))
        return events


def stop_reason(c: CompletionOutput, called: bool) -> tuple[StopReason | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sample."""
    if c.finish_reason is None:
        return None, None
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):  # a stop string matched
        return "stop_sequence", c.stop_reason
    return "end_turn", None
