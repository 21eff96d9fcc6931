"""What the parsers return: whole-output results and the events of a streaming parse."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id() -> str:
    """An OpenAI-style tool call id; random so that a client cannot guess another's ids."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One function call as OpenAI returns it: `arguments` is a JSON object as a string."""

    name: str
    arguments: str
    # Not compared: two parses of the same text give the same calls with different ids.
    id: str = field(default_factory=new_call_id, compare=False)


@dataclass(frozen=True)
class ExtractedToolCalls:
    """A whole output split into message content and tool calls.

    With no calls, `content` is the input text unchanged (even ""); with calls, it is the text
    outside them (whitespace-only stretches between calls dropped), or None when there is none.
    """

    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    """Message text (`delta.content`)."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (`delta.reasoning_content`)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """The first event of a call: `delta.tool_calls[{index, id, type: "function",
    function: {name, arguments: ""}}]`."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """A fragment of call `index`'s arguments string: `delta.tool_calls[{index, function:
    {arguments}}]`. The fragments of one call, joined, are its whole arguments string."""

    index: int
    arguments: str


ToolParserEvent = ContentDelta | ToolCallStart | ToolCallArgumentsDelta
ReasoningEvent = ReasoningDelta | ContentDelta
