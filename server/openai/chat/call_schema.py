"""JSON schemas of tool calls, shared by the grammars that force them (`required`) and that
allow them (`auto` in the generic format): each call names one of the tools and gives arguments
that follow that tool's parameters."""

from __future__ import annotations

from typing import Any

from server.openai.chat.protocol import ChatTool


def parameters(tool: ChatTool) -> dict[str, Any]:
    # No parameters: an empty object, as OpenAI calls such a function.
    return tool.function.parameters or {"type": "object", "properties": {}}


def calls_array(tools: list[ChatTool], max_calls: int | None, arguments_key: str) -> dict[str, Any]:
    """A JSON array of one call or more (up to `max_calls`; None: no limit), each
    `{"name", arguments_key}`, the name an enum of one tool so that its arguments are checked
    against that tool's own schema."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, arguments_key: parameters(t)},
            "required": ["name", arguments_key],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema
