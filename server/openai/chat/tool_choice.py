"""What a chat request's tools ask of the model, decided before it runs: whether calls are
parsed from free output (`auto`, with the server's parser), forced by a grammar (`required`, a
named function) or not wanted (`none`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.structured import SchemaError, StructuredOutputsParams, check_json_schema
from server.errors import invalid
from server.openai.chat.protocol import ChatCompletionRequest, ChatTool

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    parser: str | None = None  # the output format read in `auto`
    function: str | None = None  # the one function of `named`
    constraint: StructuredOutputsParams | None = None  # what `required` and `named` force


def _parameters(tool: ChatTool) -> dict[str, Any]:
    # No parameters: an empty object, as OpenAI calls such a function.
    return tool.function.parameters or {"type": "object", "properties": {}}


def _checked_parameters(tools: list[ChatTool], i: int) -> dict[str, Any]:
    """Tool `i`'s parameters, refused with their own field named when the grammar would not
    enforce them (the compile sees only the schema they are combined into)."""
    schema = _parameters(tools[i])
    try:
        check_json_schema(schema)
    except SchemaError as exc:
        raise invalid(str(exc), f"tools.{i}.function.parameters") from None
    return schema


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls: each item names one of the tools and gives its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The plan for this request, or a 400 naming the field that cannot be honoured."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tool function names must be unique", "tools")
    if choice == "none":
        return ToolPlan("none")
    if choice is None or choice == "auto":
        if parser is None:
            raise invalid(
                'tool_choice "auto" needs a server started with --tool-call-parser; '
                'use "required" or a named function to force a call by grammar',
                "tool_choice",
            )
        return ToolPlan("auto", parser=parser)
    if req.constraint() is not None:
        raise invalid(
            "a forced tool call cannot be combined with a structured output", "tool_choice"
        )
    if choice == "required":
        for i in range(len(tools)):
            _checked_parameters(tools, i)
        schema = _required_schema(tools, req.parallel_tool_calls)
        return ToolPlan("required", constraint=StructuredOutputsParams.json_schema(schema))
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise invalid(
            f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice"
        )
    schema = _checked_parameters(tools, names.index(name))
    return ToolPlan("named", function=name, constraint=StructuredOutputsParams.json_schema(schema))


def forced_calls(plan: ToolPlan, text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of the calls a grammar forced, or None when the output is not
    whole (cut by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        assert plan.function is not None
        return [(plan.function, json.dumps(value, ensure_ascii=False))]
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
