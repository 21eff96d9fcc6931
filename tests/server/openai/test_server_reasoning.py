"""Reasoning and tool calls through the chat route, over real HTTP with the openai client, on a
Qwen3 checkpoint scripted to write `<think>...</think>` and then a Hermes tool call (see
tests/support/scripted_model.py) under the real Qwen3 chat template: the split into reasoning_content,
content and tool_calls, streamed and whole; chat_template_kwargs reaching the template; a
grammar that waits for the reasoning to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from engine.processing.tokenization import encode_chat
from tests.engine.models.test_scripted_model import ASK, CALL, REASON_AND_CALL
from tests.support.models import tokenizer_dir
from tests.support.scripted_model import build_scripted_model, merge_scripts, script_for
from tests.support.server_harness import RunningServer, start_engine

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]
REASONING = "\nI should call a tool.\n"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from config import ServerConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))
    no_thinking = encode_chat(tok, ASK, template_kwargs={"enable_thinking": False})
    script = merge_scripts(
        script_for(tok, encode_chat(tok, ASK), REASON_AND_CALL, tok.eos_token_id),
        script_for(tok, no_thinking, CALL, tok.eos_token_id),
    )
    folder = build_scripted_model(tmp_path_factory.mktemp("scripted"), script)
    engine = start_engine(model=str(folder), num_kv_blocks=128, max_model_len=1024)
    config = ServerConfig(tool_call_parser="hermes", reasoning_parser="qwen3")
    running = RunningServer(engine, config)
    with openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
    running.stop()
    engine.shutdown()


def ask(client: openai.OpenAI, stream: bool = False, **extra: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, stream=stream, **extra
    )


def gathered(chunks: Any) -> tuple[str, str, list[tuple[str, str]], str | None]:
    reasoning, content, calls, finish = "", "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    calls.append((call.function.name, ""))
                name, arguments = calls[call.index]
                calls[call.index] = (name, arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_then_a_call_whole_and_streamed(client: openai.OpenAI) -> None:
    choice = ask(client).choices[0]
    message = choice.message
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content is None
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.finish_reason == "tool_calls"

    reasoning, content, calls, finish = gathered(ask(client, stream=True))
    assert (reasoning, content, finish) == (REASONING, "", "tool_calls")
    assert calls == [("get_weather", call.function.arguments)]


def test_chat_template_kwargs_turn_thinking_off(client: openai.OpenAI) -> None:
    extra = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    message = ask(client, **extra).choices[0].message
    assert message.model_extra["reasoning_content"] is None
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_a_forced_call_waits_for_the_reasoning_to_end(client: openai.OpenAI) -> None:
    """tool_choice required: the grammar leaves the reasoning alone (it is the script's, to the
    token) and constrains what follows </think>, where the script would have written a Hermes
    block: the call comes from the grammar's JSON instead."""
    # (Off its script the model would repeat calls until max_tokens: one call is allowed.)
    choice = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert len(json.loads(call.function.arguments)["city"]) <= 12

    # With thinking off the prompt has closed the reasoning: the grammar applies at once.
    extra = {
        "extra_body": {
            "chat_template_kwargs": {"enable_thinking": False},
            "guided_choice": ["Sunny"],
        }
    }
    message = ask(client, tool_choice="none", **extra).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Sunny", None)


def test_responses_reasoning_item_then_function_call(client: openai.OpenAI) -> None:
    """/v1/responses splits the same output into a reasoning item and a function_call item,
    counts the reasoning tokens, and streams reasoning_text events before the call's."""
    model = client.models.list().data[0].id
    tools: Any = [{"type": "function", "name": "get_weather", **TOOLS[0]["function"]}]
    common: Any = {"model": model, "input": ASK, "tools": tools, "temperature": 0}
    whole = client.responses.create(**common, max_output_tokens=80, store=False)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    reasoning, call = whole.output
    assert reasoning.content is not None and reasoning.content[0].text == REASONING
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))
    thought = "<think>" + REASONING + "</think>"
    assert whole.usage is not None
    assert whole.usage.output_tokens_details.reasoning_tokens == len(tok.encode(thought))
    assert whole.status == "completed"

    events = list(client.responses.create(**common, max_output_tokens=80, stream=True, store=False))
    kinds = [e.type for e in events]
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.reasoning_text.done") < first_call
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert (text, json.loads(arguments)) == (REASONING, {"city": "Paris"})
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "function_call"]
