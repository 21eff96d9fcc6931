"""The generic tool format, for a model whose chat template has no tool format (the default
model's ChatML ignores `tools`): the tools are described in a system message of ours, and the
output is constrained to one of two shapes,

    {"tool_calls": [{"name": "<a tool>", "arguments": {...per its schema...}}, ...]}
    plain text whose first character is neither "{" nor whitespace
    (or, when the request asks for a JSON answer with response_format, that JSON)

read back by `server/openai/parsers/generic.py`.

Why plain text and not `{"content": "..."}` for the answer: a small model ends plain text
with its end-of-turn token as it was trained to, while a JSON string asks it to close a quote
and a brace it has rarely been taught to, and it can run on to max_tokens. The calls object ends
by itself: once its last brace is written the grammar allows only the end of the output. The
first character decides the branch, so the answer streams as content from its first token.
"""

from __future__ import annotations

import json
from typing import Any

from engine.structured import StructuredOutputsParams
from server.openai.chat.call_schema import calls_array
from server.openai.chat.protocol import ChatTool
from server.openai.parsers.generic import CALLS_KEY

RESULT_PREFIX = "Tool result"


def calls_or_answer(
    tools: list[ChatTool], parallel: bool, answer: StructuredOutputsParams | None = None
) -> StructuredOutputsParams:
    """The grammar of the two shapes: the calls object, or the answer, which is free text
    unless the request constrains it to JSON (`answer`: its response_format), then that JSON.
    A regex, choice or grammar cannot join: tool_choice.py refuses them before this."""
    # At most as many calls as tools: a small model that has begun a list of calls tends to
    # repeat them until max_tokens (seen on the default model: weather, time, weather, time...),
    # and a bound lets the grammar close the list. A further call can come in the next turn.
    max_calls = len(tools) if parallel else 1
    calls: dict[str, Any] = {
        "type": "object",
        "properties": {CALLS_KEY: calls_array(tools, max_calls, "arguments")},
        "required": [CALLS_KEY],
    }
    if answer is None:
        return StructuredOutputsParams(json_or_text=json.dumps(calls, ensure_ascii=False))
    if answer.json_object:
        schema: dict[str, Any] = {"type": "object", "additionalProperties": True}
    else:
        assert answer.json is not None
        schema = json.loads(answer.json)
    # The answer's definitions stay at the root, where its "#/$defs/..." references point.
    definitions: dict[str, Any] = {
        key: schema.pop(key) for key in ("$defs", "definitions") if key in schema
    }
    return StructuredOutputsParams.json_schema({"anyOf": [calls, schema], **definitions})


def tools_prompt(tools: list[ChatTool], parallel: bool, json_answer: bool = False) -> str:
    """The system message text that tells the model its tools and the exact output format."""
    lines = ["You can call these tools:"]
    for tool in tools:
        described: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description:
            described["description"] = tool.function.description
        described["parameters"] = tool.function.parameters or {"type": "object"}
        lines.append(json.dumps(described, ensure_ascii=False))
    how_many = f"up to {len(tools)} calls" if parallel and len(tools) > 1 else "exactly one call"
    lines += [
        "",
        "To call tools, reply with only this JSON object and nothing else "
        f"({how_many}; each name is a tool above, its arguments follow that tool's parameters):",
        '{"' + CALLS_KEY + '": [{"name": "TOOL_NAME", "arguments": {...}}]}',
        "To answer without a tool, reply with the JSON answer asked for."
        if json_answer
        else 'To answer without a tool, reply in plain text that does not begin with "{".',
        f'Tool results come back in user messages that begin with "{RESULT_PREFIX}".',
    ]
    return "\n".join(lines)


def _calls_text(calls: list[dict[str, Any]]) -> str:
    """An earlier turn's calls written as the model is asked to write them."""
    written = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]
    return json.dumps({CALLS_KEY: written}, ensure_ascii=False)


def generic_messages(
    messages: list[dict[str, Any]],
    tools: list[ChatTool],
    parallel: bool,
    json_answer: bool = False,
) -> list[dict[str, Any]]:
    """The conversation (as `chat_messages` gives it) for a template that knows no tools: our
    system message first (after the client's own system text, if any), earlier calls written in
    the generic format, and each run of tool results as one user message (templates that know no
    `tool` role often allow only alternating user and assistant turns)."""
    names: dict[str, str] = {}
    shaped: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            # Only the calls: the model is asked to write either a call or text, never both.
            shaped.append({"role": "assistant", "content": _calls_text(calls)})
        elif role == "tool":
            name = names.get(message.get("tool_call_id", ""), "a tool")
            result = f"{RESULT_PREFIX} of {name}: {message['content']}"
            if shaped and shaped[-1].get("tool_results"):
                shaped[-1]["content"] += "\n" + result
            else:
                shaped.append({"role": "user", "content": result, "tool_results": True})
        else:
            shaped.append(dict(message))
    for message in shaped:
        message.pop("tool_results", None)
    prompt = tools_prompt(tools, parallel, json_answer)
    if shaped and shaped[0]["role"] == "system":
        first = shaped[0]
        shaped[0] = {**first, "content": f"{first['content']}\n\n{prompt}".lstrip()}
    else:
        shaped.insert(0, {"role": "system", "content": prompt})
    return shaped
