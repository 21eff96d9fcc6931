"""Tool calling over real HTTP with the official openai client: `required` and a named function
forced by a grammar on the default model (whose free output would rarely be a call), `auto` on
a server started with no tool flag (the default model's ChatML: the generic format, a call or an
answer, each steered in turn; the Qwen3 template: hermes, chosen at start-up), `auto` parsed
from a random-weight Qwen3's output in each named format (forced by a test grammar), streamed
as OpenAI streams calls, and OpenAI 400s for bad tools, choices and tool messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.server_harness import RunningServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in UTC?"}]


def check_calls(calls: Any) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_valid_calls(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls or []}) == len(
        choice.message.tool_calls or []
    )

    sampled = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        n=3,
        seed=4,
        max_tokens=80,
    )
    for choice in sampled.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls or []) == 1
        check_calls(choice.message.tool_calls)


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, str]], str | None]:
    """Calls assembled from the deltas, checking OpenAI's shape: id, type and name come once,
    in a call's first delta, and later deltas carry only argument fragments."""
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls) and delta.type == "function"
                    assert delta.function is not None and delta.function.name
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    assert delta.function is not None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return calls, finish


def test_named_function_streamed_equals_whole(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    common: Any = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": named,
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = client.chat.completions.create(**common).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls or []
    assert call.function.name == "get_time"
    check_calls([call])
    calls, finish = streamed_calls(client, **common)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]

    calls, finish = streamed_calls(client, **{**common, "tool_choice": "required"})
    assert finish == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


# The question, the model's call of get_time, and the tool's result: a turn to answer.
ANSWERED_TIME: Any = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]


def test_a_conversation_with_calls_and_results(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=ANSWERED_TIME,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=20,
    )
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


CALL: Any = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_time", "arguments": "{}"},
}
UNENFORCED_TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {**TIME, "dependentRequired": {"timezone": ["city"]}},
    },
}
BAD = [
    # The generic format's grammar cannot be merged with a regex the request brings.
    ({"tool_choice": "auto", "guided_regex": "[a-z]+"}, "guided_regex"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "messages.1.tool_call_id",
    ),
    (
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "x"}]}]},
        "messages.1.tool_calls.0.function",
    ),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    # A forced call's parameters that the grammar would not enforce, named by the tool.
    (
        {"tools": [TOOLS[0], UNENFORCED_TIME], "tool_choice": "required"},
        "tools.1.function.parameters",
    ),
    (
        {
            "tools": [TOOLS[0], UNENFORCED_TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        "tools.1.function.parameters",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tools_and_tool_messages_are_400s(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    base = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 5}
    body = {**base, **fields}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, error
        ok = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 3}
        )
        assert ok.status_code == 200


# --------------------------------------------------------------------------- auto, parsed

ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
# What each format's model writes: a sentence, then one call (llama3_json: the call alone, since
# its marker <|python_tag|> is a special token that no grammar can force).
OUTPUTS = {
    "hermes": (
        "Let me check.\n",
        '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>",
    ),
    "mistral": (
        "Let me check.",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGUMENTS + "}]",
    ),
    "llama3_json": ("", '{"name": "get_weather", "parameters": ' + ARGUMENTS + "}"),
}


@pytest.fixture(scope="module")
def qwen_engine(qwen3_dir: Path) -> Iterator[Any]:
    """A random-weight Qwen3 with the real Qwen3 chat template."""
    from tests.support.server_harness import start_engine

    engine = start_engine(model=str(qwen3_dir), num_kv_blocks=256, max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_auto_parses_each_format(qwen_engine: Any, parser: str) -> None:
    from config import ServerConfig

    running = RunningServer(qwen_engine, ServerConfig(tool_call_parser=parser))
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        check_auto(client, *OUTPUTS[parser])
    finally:
        client.close()
        running.stop()


def check_auto(client: openai.OpenAI, before: str, call_text: str) -> None:
    # The test grammar stands in for a model trained to call.
    grammar = "root ::= " + json.dumps(before + call_text)
    common: Any = {
        "model": client.models.list().data[0].id,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,  # a random model spells the forced text in short tokens
        "extra_body": {"guided_grammar": grammar},
    }
    choice = client.chat.completions.create(**common).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == (before or None)
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)
    calls, finish = streamed_calls(client, **common)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", ARGUMENTS)]

    # Without a call in the output, auto gives content and finishes with "stop".
    plain = {**common, "extra_body": {"guided_choice": ["No tools needed."]}}
    choice = client.chat.completions.create(**plain).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "No tools needed.",
        [],
        "stop",
    )


# --------------------------------------------------------------------------- auto, no flag

# Tokens of the default model's vocabulary that steer the first choice of the generic format:
# '{"' can only open the calls object; "Hello" can only begin a plain answer.
OPEN_OBJECT, HELLO = 39428, 19556


def generic_auto(
    client: openai.OpenAI, **kwargs: Any
) -> tuple[str | None, list[tuple[str, str]], str | None, bool]:
    """One auto request, whole and streamed (greedy, so the two must agree): content, calls
    (name, arguments), finish_reason, and whether it was a call. Checks that the shape is
    well formed and its finish_reason consistent with it."""
    common: Any = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": 60,
        **kwargs,
    }
    whole = client.chat.completions.create(**common).choices[0]
    calls = whole.message.tool_calls or []
    if calls:
        check_calls(calls)
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
    else:
        assert whole.message.content and whole.finish_reason in ("stop", "length")
    pairs = [(c.function.name, c.function.arguments) for c in calls]

    text, streamed, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **common):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.id.startswith("call_") and delta.function is not None
                    streamed.append([delta.function.name, ""])
                streamed[delta.index][1] += (delta.function and delta.function.arguments) or ""
    assert [tuple(c) for c in streamed] == pairs and finish == whole.finish_reason
    assert text == (whole.message.content or "")
    return whole.message.content, pairs, whole.finish_reason, bool(calls)


def test_auto_needs_no_flag_on_the_default_model(client: openai.OpenAI) -> None:
    """The session server was started with no tool flag; its ChatML template has no tool
    format, so auto answers in the generic one: a call or an answer, whole and streamed."""
    generic_auto(client)  # either shape, well formed
    generic_auto(client, messages=[{"role": "user", "content": "Write a haiku about rain."}])


def test_auto_steered_to_a_call_returns_tool_calls(client: openai.OpenAI) -> None:
    content, calls, finish, called = generic_auto(
        client, logit_bias={str(OPEN_OBJECT): 100}, max_tokens=120
    )
    assert called and content is None and finish == "tool_calls"
    assert calls and all(name in SCHEMAS for name, _ in calls)
    one, calls, _, _ = generic_auto(
        client, logit_bias={str(OPEN_OBJECT): 100}, max_tokens=120, parallel_tool_calls=False
    )
    assert one is None and len(calls) == 1


def test_auto_steered_to_text_returns_content(client: openai.OpenAI) -> None:
    content, calls, finish, called = generic_auto(client, logit_bias={str(HELLO): 100})
    assert not called and calls == []
    assert content is not None and content.startswith("Hello") and finish == "length"


def test_auto_answers_after_a_tool_result(client: openai.OpenAI) -> None:
    generic_auto(client, messages=ANSWERED_TIME)
    content, _, _, called = generic_auto(
        client, messages=ANSWERED_TIME, logit_bias={str(HELLO): 100}
    )
    assert not called and content and content.startswith("Hello")


def test_auto_with_a_response_format_is_a_call_or_that_json(client: openai.OpenAI) -> None:
    """What the OpenAI Agents SDK sends for an agent with tools and an output type."""
    city: Any = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}},
        "required": ["name"],
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "c", "schema": city}}
    for messages in (ASK, [{"role": "user", "content": "Name a city in France, as JSON."}]):
        content, _, _, called = generic_auto(
            client, messages=messages, response_format=response_format
        )
        if not called:
            assert content is not None
            jsonschema.validate(json.loads(content), city)


def test_no_flag_on_a_qwen3_template_chooses_hermes(
    qwen_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from config import ServerConfig

    with caplog.at_level("INFO", logger="server.app"):
        running = RunningServer(qwen_engine, ServerConfig())
    assert any(
        "the hermes format" in r.getMessage() and "<tool_call>" in r.getMessage()
        for r in caplog.records
    )
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        check_auto(client, *OUTPUTS["hermes"])
    finally:
        client.close()
        running.stop()
