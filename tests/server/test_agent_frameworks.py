"""Agent frameworks as clients, over real HTTP against the default model: LangChain's ChatOpenAI
(structured output, bound tools, streamed tool calls) and the OpenAI Agents SDK, on chat
completions and on its default Responses model (a function tool called and run, a typed final
output). Each sends its own request shapes (strict schemas, parallel_tool_calls, stream_options,
Responses items), which the server must take as OpenAI would."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import operator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.support.readme import python_examples, run_example
from tests.support.server_harness import RunningServer

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


@pytest.fixture(scope="module")
def chat_model(server: RunningServer) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=60,  # type: ignore[call-arg]
        max_retries=0,
        timeout=120,
    )


def test_langchain_structured_output(chat_model: Any) -> None:
    structured = chat_model.with_structured_output(City, method="json_schema", strict=True)
    city = structured.invoke("Name a city in France.")
    assert isinstance(city, City) and city.name and city.country


def test_langchain_bound_tools_whole_and_streamed(chat_model: Any) -> None:
    bound = chat_model.bind_tools([get_weather], tool_choice="required")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")

    chunks = list(bound.stream("What is the weather in Paris?"))
    gathered = functools.reduce(operator.add, chunks)
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [(call["name"], call["args"])]


def test_langchain_bound_tools_with_auto_on_a_server_with_no_tool_flag(
    server: RunningServer, chat_model: Any
) -> None:
    """bind_tools' default tool_choice is auto: the session server has no tool flag, so the
    default model answers in the generic format, a call or content, whole and streamed."""
    from langchain_openai import ChatOpenAI

    bound = chat_model.bind_tools([get_weather])
    message = bound.invoke("What is the weather in Paris?")
    assert message.tool_calls or (message.content and not message.invalid_tool_calls)
    for call in message.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    gathered = functools.reduce(operator.add, bound.stream("What is the weather in Paris?"))
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [
        (c["name"], c["args"]) for c in message.tool_calls
    ]
    assert gathered.content == message.content

    # Steered to open the calls object ('{"' of the default model's vocabulary): a call.
    steered = ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=60,  # type: ignore[call-arg]
        max_retries=0,
        logit_bias={39428: 100},
    ).bind_tools([get_weather])
    (call,) = steered.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")


@pytest.mark.parametrize(
    ("api", "streamed"),
    [("chat", False), ("responses", False), ("responses", True)],
    ids=["chat-completions", "responses", "responses-streamed"],
)
def test_openai_agents_sdk_runs_a_tool_and_returns_a_typed_output(
    server: RunningServer, api: str, streamed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """On the chat completions adapter and on the SDK's default Responses model, run and
    streamed, with no warning from the SDK."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent anywhere
    caplog.set_level(logging.WARNING, logger="openai.agents")

    async def run_agent(agent: Any, text: str, max_turns: int) -> Any:
        if not streamed:
            return await Runner.run(agent, text, max_turns=max_turns)
        result = Runner.run_streamed(agent, text, max_turns=max_turns)
        async for _ in result.stream_events():
            pass
        return result

    async def run() -> tuple[Any, Any]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        model = model_class(model=MODEL, openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=60)
        caller = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[function_tool(get_weather)],
            model=model,
            model_settings=settings.resolve(ModelSettings(tool_choice="required")),
            tool_use_behavior="stop_on_first_tool",  # the tool's answer is the final output
        )
        called = await run_agent(caller, "What is the weather in Paris?", 2)
        typed = Agent(
            name="cities",
            instructions="Name a city.",
            model=model,
            model_settings=settings,
            output_type=City,
        )
        named = await run_agent(typed, "Name a city in France.", 1)
        await client.close()
        return called, named

    called, named = asyncio.run(run())
    calls = [i for i in called.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in called.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(calls) == 1 and len(outputs) == 1
    city = json.loads(calls[0].raw_item.arguments)["city"]
    assert called.final_output == f"Sunny in {city}"
    assert isinstance(named.final_output, City)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("openai.agents")] == []


def test_docs_langchain_example_runs(server: RunningServer) -> None:
    """The agent-frameworks example (docs/openai-api.md), as written, against a server with no
    flags: a typed city, then a bound tool with auto choice answered by a call or by text."""
    (snippet,) = python_examples("Agent frameworks", page="openai-api.md")
    city, _, reply = run_example(server.url, "python", snippet).strip().partition("\n")
    name, country = city.split(" / ")
    assert name.strip() and country.strip()
    assert reply == "['get_weather']" or (reply.strip() and not reply.startswith("["))
