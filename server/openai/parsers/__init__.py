"""Parsers of what a model writes: tool calls and reasoning, read from the output text.

Names are vLLM's `--tool-call-parser` and `--reasoning-parser` values. Each parser class has a
whole-output `extract(text)` classmethod, and an instance is a streaming parser for one output:
`feed(delta)` and then `finish()` return events. They read text only: the server decodes the
tokens (keeping special tokens where a format's marker is one) and maps events to its response.
"""

from __future__ import annotations

from server.openai.parsers.generic import GenericToolParser
from server.openai.parsers.hermes import HermesToolParser
from server.openai.parsers.llama3_json import Llama3JsonToolParser
from server.openai.parsers.mistral import MistralToolParser
from server.openai.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)
from server.openai.parsers.tool_parser import ToolCallParser
from server.openai.parsers.types import (
    ContentDelta,
    ExtractedToolCalls,
    ReasoningDelta,
    ReasoningEvent,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolParserEvent,
    new_call_id,
)

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p
    for p in (GenericToolParser, HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}
# For the CLI flags' choices.
TOOL_CALL_PARSER_NAMES: tuple[str, ...] = tuple(sorted(TOOL_CALL_PARSERS))
REASONING_PARSER_NAMES: tuple[str, ...] = tuple(sorted(REASONING_PARSERS))


def tool_call_parser_for(name: str) -> type[ToolCallParser]:
    """The tool-call parser class named `name`; ValueError listing the names otherwise."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSER_NAMES)}"
        ) from None


def reasoning_parser_for(name: str) -> type[ReasoningParser]:
    """The reasoning parser class named `name`; ValueError listing the names otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSER_NAMES)}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSERS",
    "TOOL_CALL_PARSER_NAMES",
    "ContentDelta",
    "DeepSeekR1ReasoningParser",
    "ExtractedToolCalls",
    "GenericToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningEvent",
    "ReasoningParser",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallParser",
    "ToolCallStart",
    "ToolParserEvent",
    "new_call_id",
    "reasoning_parser_for",
    "tool_call_parser_for",
]
