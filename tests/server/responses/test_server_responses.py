"""The Responses API over real HTTP with the official openai client on the default model: text
and item inputs, instructions, max_output_tokens -> incomplete, text.format json_schema,
forced function calls and a function_call_output round trip, the streamed events (names,
order, sequence numbers, text equal to the whole answer), stored responses (continue, retrieve,
input items, delete), and OpenAI-shaped 400s/404s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from config import ServerConfig
from engine.async_engine import AsyncEngine
from tests.support.readme import run_example, section_examples
from tests.support.redis_server import running_redis
from tests.support.server_harness import (
    MAX_MODEL_LEN as TINY_CONTEXT,
)
from tests.support.server_harness import (
    RunningServer,
    scrape,
    start_tiny_server,
    value,
    wait_until,
    wait_until_idle,
)

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def tiny_server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    engine, running = start_tiny_server(llama_dir, tmp_path_factory.mktemp("chat-tokenizer"))
    yield running
    running.stop()
    engine.shutdown()


def test_text_and_items_inputs_with_instructions(client: openai.OpenAI) -> None:
    plain = client.responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24
    )
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.status in ("completed", "incomplete")
    assert plain.output_text and plain.output[0].type == "message"
    assert plain.usage is not None and plain.usage.output_tokens <= 24
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens

    items = client.responses.create(
        model=MODEL,
        instructions="Answer in one word.",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the capital of France?"}],
            }
        ],
        temperature=0,
        max_output_tokens=24,
    )
    assert items.instructions == "Answer in one word."
    # One engine path: the same conversation as a chat request gives the same prompt and text.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        temperature=0,
        max_completion_tokens=24,
    )
    assert items.usage is not None and chat.usage is not None
    assert items.usage.input_tokens == chat.usage.prompt_tokens
    assert items.output_text == chat.choices[0].message.content

    cut = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3)
    assert cut.status == "incomplete"
    assert (
        cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
    )
    assert cut.usage is not None and cut.usage.output_tokens == 3


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        temperature=0,
        max_output_tokens=60,
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), PERSON)


def test_forced_function_call_then_its_output(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        first = client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_output_tokens=40,
        )
        calls = [item for item in first.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert calls[0].call_id.startswith("call_")
        arguments = json.loads(calls[0].arguments)
        jsonschema.validate(arguments, WEATHER["parameters"])
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
        store=False,
    )
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]


def test_auto_needs_no_flag_and_gives_a_call_or_a_message(client: openai.OpenAI) -> None:
    """tool_choice auto (the default) on the default model, served with no tool flag: the
    generic format, through the same prepared chat path."""
    for ask in ("What is the weather in Paris?", "Write one sentence about rain."):
        out = client.responses.create(
            model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=60
        )
        assert out.status in ("completed", "incomplete")
        calls = [item for item in out.output if item.type == "function_call"]
        if calls:
            assert [c.name for c in calls] == ["get_weather"]
            jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
            assert not out.output_text
        else:
            assert out.output_text and not out.output_text.startswith("{")


def test_streamed_events_and_text_equal_the_whole(client: openai.OpenAI) -> None:
    common: Any = {
        "model": MODEL,
        "input": "Write a haiku about caches.",
        "temperature": 0,
        "max_output_tokens": 30,
    }
    whole = client.responses.create(**common, store=False)
    events = list(client.responses.create(**common, stream=True, store=False))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text

    with client.responses.stream(
        model=MODEL, input="Say hi.", temperature=0, max_output_tokens=48, store=False
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # needs a response.completed event
    assert final.status == "completed" and final.output_text == "".join(deltas)


def test_stored_responses_continue_retrieve_list_and_delete(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada. Remember it.", temperature=0, max_output_tokens=20
    )
    again = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=20,
    )
    assert again.previous_response_id == first.id
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0
    assert again.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = client.responses.input_items.list(again.id)
    assert [i.type for i in items.data] == ["message"]
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_input_items_are_paged_as_openai_pages_them(
    client: openai.OpenAI, server: RunningServer
) -> None:
    said = ["one", "two", "three", "four", "five"]
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": s} for i, s in enumerate(said)
    ]
    created = client.responses.create(model=MODEL, input=turns, max_output_tokens=1)  # type: ignore[arg-type]

    def text(item: dict[str, Any]) -> str:
        return item["content"][0]["text"]

    with httpx.Client(base_url=server.url, timeout=60) as http:

        def page(**query: Any) -> dict[str, Any]:
            response = http.get(f"/v1/responses/{created.id}/input_items", params=query)
            assert response.status_code == 200, response.text
            return response.json()

        newest = page()  # newest first, 20 at most
        assert [text(i) for i in newest["data"]] == said[::-1] and not newest["has_more"]
        ids = [i["id"] for i in newest["data"]]
        assert (newest["first_id"], newest["last_id"]) == (ids[0], ids[-1])
        first = page(limit=2)
        assert [text(i) for i in first["data"]] == ["five", "four"] and first["has_more"]
        assert first["last_id"] == ids[1]
        second = page(limit=2, after=first["last_id"])
        assert [text(i) for i in second["data"]] == ["three", "two"] and second["has_more"]
        last = page(limit=2, after=second["last_id"])
        assert [text(i) for i in last["data"]] == ["one"] and not last["has_more"]
        oldest = page(order="asc", limit=3)
        assert [text(i) for i in oldest["data"]] == said[:3] and oldest["has_more"]
        # Before a cursor: the items nearest it, in the same order.
        near = page(order="asc", limit=2, before=ids[0])
        assert [text(i) for i in near["data"]] == ["three", "four"] and near["has_more"]
        between = page(order="asc", after=ids[4], before=ids[0])
        assert [text(i) for i in between["data"]] == ["two", "three", "four"]
        assert not between["has_more"]

        for query, param in [
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"limit": "abc"}, "limit"),
            ({"order": "sideways"}, "order"),
            ({"after": "msg_unknown"}, "after"),
            ({"before": "msg_unknown"}, "before"),
        ]:
            response = http.get(f"/v1/responses/{created.id}/input_items", params=query)
            assert response.status_code == 400, (query, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, error

    # The SDK's auto-pagination follows has_more and last_id through every page.
    listed = list(client.responses.input_items.list(created.id, limit=2))
    assert [i.content[0].text for i in listed] == said[::-1]  # type: ignore[union-attr]


BAD = [
    ({"input": [{"type": "image_generation_call"}]}, "input.0.type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input.0.content.0",  # (the model reads no images)
    ),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include.1"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
        "text.format.schema",
    ),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
        "text.format.schema",
    ),
    (
        {
            "tools": [
                {"type": "function", "name": "f", "parameters": {"type": "object", "if": {}}}
            ],
            "tool_choice": "required",
        },
        "tools.0.parameters",
    ),
    ({"max_output_tokens": 9000}, "max_output_tokens"),
    ({"metadata": {str(i): "x" for i in range(17)}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_requests_are_openai_400s(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/responses", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert (
            http.post(
                "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2}
            ).status_code
            == 200
        )
        assert http.get("/v1/responses/resp_unknown").status_code == 404


def test_client_leaving_mid_stream_aborts_its_request(server: RunningServer) -> None:
    aborted = value(scrape(server.url), "request_success_total", finished_reason="abort")
    body = {
        "model": MODEL,
        "input": "Count from 1 to 500, separated by commas.",
        "temperature": 0,
        "max_output_tokens": 400,
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/responses", json=body) as response,
    ):
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 5:
                break  # closing the stream drops the connection
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks
    wait_until(
        lambda: value(scrape(server.url), "request_success_total", finished_reason="abort"),
        10,
        until=lambda now: now == aborted + 1,
        interval=0.1,
        what="the abort to be counted",
    )


def test_store_none_keeps_nothing(default_engine: AsyncEngine) -> None:
    running = RunningServer(
        default_engine, ServerConfig(served_model_name=[MODEL], responses_store="none")
    )
    try:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as sdk:
            first = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve(first.id)
            with pytest.raises(openai.BadRequestError) as refused:
                sdk.responses.create(
                    model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=first.id
                )
            error = refused.value.body
            assert isinstance(error, dict) and error["param"] == "previous_response_id"
            assert "--responses-store none" in error["message"]
    finally:
        running.stop()


def start_conversation(sdk: openai.OpenAI) -> Any:
    return sdk.responses.create(
        model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=8
    )


def continue_conversation(sdk: openai.OpenAI, started: Any) -> Any:
    """`started` (stored through another server) found and continued through `sdk`'s server."""
    assert sdk.responses.retrieve(started.id).output_text == started.output_text
    went_on = sdk.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=started.id, max_output_tokens=4
    )
    assert went_on.usage is not None and started.usage is not None
    assert went_on.usage.input_tokens > started.usage.input_tokens
    return went_on


def test_sqlite_store_survives_a_restart(default_engine: AsyncEngine, tmp_path: Path) -> None:
    config = ServerConfig(
        served_model_name=[MODEL], responses_store=f"sqlite://{tmp_path}/responses.sqlite3"
    )
    before = RunningServer(default_engine, config)
    try:
        with openai.OpenAI(base_url=before.url + "/v1", api_key="x", max_retries=0) as sdk:
            first = start_conversation(sdk)
    finally:
        before.stop()
    after = RunningServer(default_engine, config)
    try:
        with openai.OpenAI(base_url=after.url + "/v1", api_key="x", max_retries=0) as sdk:
            continue_conversation(sdk, first)
    finally:
        after.stop()


def test_truncation_auto_drops_the_oldest_turns(tiny_server: RunningServer) -> None:
    """A 64-token context: four ~20-token turns do not fit; `auto` keeps the newest that do."""
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "word " * 12}
        for i in range(4)
    ]
    body = {"input": turns, "max_output_tokens": 4, "store": False}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as http:
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded"), error

        def prompt_len(messages: list[dict[str, Any]]) -> int:
            response = http.post("/tokenize", json={"messages": messages})
            return int(response.json()["count"])

        kept = next(i for i in range(len(turns)) if prompt_len(turns[i:]) + 4 <= TINY_CONTEXT)
        assert 0 < kept < len(turns) - 1  # some turns dropped, more than one left
        cut = http.post("/v1/responses", json={**body, "truncation": "auto"})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["input_tokens"] == prompt_len(turns[kept:])
        assert cut.json()["truncation"] == "auto"


def test_docs_responses_examples_run(server: RunningServer) -> None:
    """The curl and Agents SDK examples of docs/responses.md, as written."""
    curl, snippet = section_examples("Responses API", page="responses.md")
    reply = json.loads(run_example(server.url, "bash", curl))
    assert reply["object"] == "response" and reply["instructions"] == "Answer in one word."
    (message,) = reply["output"]
    assert message["type"] == "message" and message["content"][0]["text"].strip()

    printed = run_example(server.url, "python", snippet)
    assert printed.startswith("Sunny in ") and printed.strip() != "Sunny in"


def test_two_servers_share_a_redis_store(default_engine: AsyncEngine, tmp_path: Path) -> None:
    """Replicas behind one load balancer: a response created on one continues on the other;
    when Redis goes down the store's routes answer 503 and the rest keeps serving."""
    with ExitStack() as servers:
        with running_redis(tmp_path / "redis") as url:
            config = ServerConfig(served_model_name=[MODEL], responses_store=url)
            one, two = (RunningServer(default_engine, config) for _ in range(2))
            servers.callback(one.stop)
            servers.callback(two.stop)
            first = servers.enter_context(
                openai.OpenAI(base_url=one.url + "/v1", api_key="x", max_retries=0)
            )
            second = servers.enter_context(
                openai.OpenAI(base_url=two.url + "/v1", api_key="x", max_retries=0)
            )
            started = start_conversation(first)
            went_on = continue_conversation(second, started)
            listed = first.responses.input_items.list(went_on.id).data
            assert [i.type for i in listed] == ["message"]
        # Redis has stopped: storing, reading and continuing are 503s, nothing else is.
        http = servers.enter_context(httpx.Client(base_url=one.url, timeout=60))
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
        for response in (
            http.post("/v1/responses", json=body),
            http.post("/v1/responses", json={**body, "previous_response_id": started.id}),
            http.get(f"/v1/responses/{started.id}"),
            http.delete(f"/v1/responses/{started.id}"),
        ):
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "response_store_error" and "redis" not in error["message"]
        assert http.post("/v1/responses", json={**body, "store": False}).status_code == 200
        assert http.get("/health").status_code == 200
