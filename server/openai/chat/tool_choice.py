"""What a chat request's tools ask of the model, decided before it runs: whether calls are
parsed from free output (`auto`, with the server's parser; in the generic format, free output
narrowed by a grammar to a calls object or text), forced by a grammar (`required`, a named
function) or not wanted (`none`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from engine.structured import SchemaError, StructuredOutputsParams, check_json_schema
from server.errors import invalid
from server.openai.chat.call_schema import calls_array, parameters
from server.openai.chat.generic_tools import calls_or_answer
from server.openai.chat.protocol import ChatCompletionRequest, ChatTool

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    parser: str | None = None  # the output format read in `auto`
    function: str | None = None  # the one function of `named`
    # What `required` and `named` force, and what `auto` in the generic format allows.
    constraint: StructuredOutputsParams | None = None


def _check_parameters(tools: list[ChatTool], only: int | None = None) -> None:
    """Each tool's parameters (or tool `only`'s), refused with their own field named when the
    grammar would not enforce them (the compile sees only the schema they are combined into)."""
    for i, tool in enumerate(tools):
        if only is not None and i != only:
            continue
        try:
            check_json_schema(parameters(tool))
        except SchemaError as exc:
            raise invalid(str(exc), f"tools.{i}.function.parameters") from None


def plan_tools(req: ChatCompletionRequest, parser: str) -> ToolPlan:
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
        if parser != "generic":
            return ToolPlan("auto", parser=parser)
        # The generic format tells calls from answers by a grammar of its own; an answer the
        # request constrains to JSON (response_format) becomes that grammar's other branch.
        given = req.constraint()
        if given is not None and given[0].json is None and not given[0].json_object:
            raise invalid(
                f'tool_choice "auto" cannot be combined with {given[1]} on this model: its chat '
                "template has no tool format, so calls are told apart from answers by a JSON "
                'grammar, which only a JSON answer can join; use tool_choice "required" or '
                '"none", or start the server with --tool-call-parser naming the model\'s format',
                given[1],
            )
        _check_parameters(tools)
        allowed = calls_or_answer(tools, req.parallel_tool_calls, given[0] if given else None)
        return ToolPlan("auto", parser=parser, constraint=allowed)
    if req.constraint() is not None:
        raise invalid(
            "a forced tool call cannot be combined with a structured output", "tool_choice"
        )
    if choice == "required":
        _check_parameters(tools)
        schema = calls_array(tools, None if req.parallel_tool_calls else 1, "parameters")
        return ToolPlan("required", constraint=StructuredOutputsParams.json_schema(schema))
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise invalid(
            f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice"
        )
    tool = tools[names.index(name)]
    _check_parameters(tools, only=names.index(name))
    return ToolPlan(
        "named", function=name, constraint=StructuredOutputsParams.json_schema(parameters(tool))
    )


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
