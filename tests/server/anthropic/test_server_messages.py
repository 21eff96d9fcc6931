"""Anthropic's Messages API over real HTTP with the official `anthropic` SDK, on the default
model: plain and system-prompted messages, a forced tool whose input follows its schema, a
tool_result round trip, streams that accumulate to the whole message, count_tokens against the
chat template's own count, stop sequences, and errors in Anthropic's shape as the SDK's classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.support.readme import run_example, section_examples
from tests.support.server_harness import RunningServer

MODEL = "SmolLM2-135M-Instruct"
# The SDK no longer takes sampling fields; the server still reads them (older clients send them).
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> Any:
    import anthropic

    with anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def template(default_model_dir: Path) -> Any:
    """The model's own tokenizer and chat template, through transformers: the count to match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def real_count(template: Any, messages: list[dict[str, Any]]) -> int:
    encoded = template.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(encoded["input_ids"])


def test_plain_message_counts_its_prompt_and_says_why_it_stopped(
    claude: Any, template: Any
) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Name a colour."}],
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    want = real_count(template, [{"role": "user", "content": "Name a colour."}])
    assert message.usage.input_tokens == want
    assert 0 < message.usage.output_tokens <= 12


def test_system_prompt_and_blocks_run_as_the_same_chat(
    claude: Any, client: Any, template: Any
) -> None:
    """A system prompt given as blocks and user text in blocks: the same prompt, and at
    temperature 0 the same answer, as the chat request with those messages."""
    chat = [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Say hello."},
    ]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        system=[{"type": "text", "text": "You answer in French."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
    )
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, messages=chat
    )
    assert message.content[0].text == completion.choices[0].message.content
    assert message.usage.input_tokens == real_count(template, chat)
    count = claude.messages.count_tokens(
        model=MODEL,
        system="You answer in French.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert count.input_tokens == message.usage.input_tokens


# The weather tool forced on a question: its prompt (count_tokens takes this alone), then the
# whole request.
WEATHER_ASK: dict[str, Any] = {
    "model": MODEL,
    "tools": [WEATHER],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
}
FORCED_WEATHER: dict[str, Any] = {**WEATHER_ASK, "max_tokens": 40, "extra_body": GREEDY}


def forced_weather(claude: Any) -> Any:
    return claude.messages.create(**FORCED_WEATHER)


def test_forced_tool_use_follows_its_schema(claude: Any) -> None:
    message = forced_weather(claude)
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert message.stop_reason == "tool_use"


def test_tool_result_round_trip_is_the_chat_tool_message(claude: Any, client: Any) -> None:
    """The call, then its result: the answer equals the chat request that carries the same call
    and a tool message with the same result (so the blocks reached the template as those)."""
    use = next(b for b in forced_weather(claude).content if b.type == "tool_use")
    message = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [use.model_dump()]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"},
                    {"type": "text", "text": "Tell me in one sentence."},
                ],
            },
        ],
    )
    arguments = json.dumps(use.input, ensure_ascii=False)
    completion = client.chat.completions.create(
        model=MODEL,
        max_tokens=16,
        extra_body=GREEDY,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"],
                },
            }
        ],
        tool_choice="none",
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
            {"role": "user", "content": "Tell me in one sentence."},
        ],
    )
    assert message.content[0].type == "text"
    assert message.content[0].text == completion.choices[0].message.content
    assert message.usage.input_tokens == completion.usage.prompt_tokens


def test_streamed_text_accumulates_to_the_whole_message(claude: Any) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 20,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Write a short sentence about cats."}],
    }
    whole = claude.messages.create(**body)
    kinds = []
    with claude.messages.stream(**body) as stream:
        for e in stream:
            kinds.append(e.type)
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert [b.model_dump(include={"type", "text"}) for b in streamed.content] == [
        b.model_dump(include={"type", "text"}) for b in whole.content
    ]
    assert (streamed.stop_reason, streamed.usage) == (whole.stop_reason, whole.usage)


def test_streamed_tool_use_accumulates_to_the_whole_call(claude: Any) -> None:
    whole = forced_weather(claude)
    with claude.messages.stream(**FORCED_WEATHER) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(deltas) == {"input_json_delta"}
    (a,), (b,) = ([x for x in m.content if x.type == "tool_use"] for m in (streamed, whole))
    assert (a.name, a.input) == (b.name, b.input)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"


def test_tools_with_auto_choice_need_no_flag(claude: Any) -> None:
    """Anthropic's default tool_choice (auto) on the default model, whose template has no tool
    format: the answer is a tool use that follows the schema or text, its stop_reason says
    which, and the stream accumulates to the same message."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 60,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    whole = claude.messages.create(**body)
    uses = [b for b in whole.content if b.type == "tool_use"]
    if uses:
        assert whole.stop_reason == "tool_use"
        for use in uses:
            assert use.name == "get_weather"
            jsonschema.validate(use.input, WEATHER["input_schema"])
    else:
        assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].text
    with claude.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in streamed.content] == [
        b.model_dump(exclude={"parsed_output"}) for b in whole.content
    ]
    assert streamed.stop_reason == whole.stop_reason


def test_count_tokens_with_tools_matches_the_message(claude: Any) -> None:
    count = claude.messages.count_tokens(**WEATHER_ASK)
    assert count.input_tokens == forced_weather(claude).usage.input_tokens


def test_stop_sequence_is_named(claude: Any) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Write a short sentence about dogs."}],
    }
    text = claude.messages.create(**body).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    word = words[2]
    message = claude.messages.create(**body, stop_sequences=[word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == text[: text.index(word)]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_output_format_gives_the_typed_object(claude: Any) -> None:
    """`messages.parse(output_format=...)` sends output_config.format: the text is JSON that the
    schema allows, and the SDK parses it into the model."""
    message = claude.messages.parse(
        model=MODEL,
        max_tokens=60,
        extra_body=GREEDY,
        output_format=City,
        messages=[{"role": "user", "content": "Name a city in France."}],
    )
    assert message.stop_reason == "end_turn"
    city = message.parsed_output
    assert isinstance(city, City) and city.name and city.country


# --------------------------------------------------------------------------- errors


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                        ],
                    }
                ]
            },
            f"messages.0.content.0: the model {MODEL} reads no images",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_bad_requests_are_anthropic_400s_naming_the_field(
    server: RunningServer, change: dict[str, Any], named: str
) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert anthropic_error(response, 400, "invalid_request_error").startswith(named)


HI = {"role": "user", "content": "hi"}


def test_too_many_stop_sequences_are_refused_in_words(server: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [HI], "stop_sequences": list("abcde")}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    message = anthropic_error(response, 400, "invalid_request_error")
    assert message == "stop_sequences: at most 4 stop sequences, got 5"
    four = {**body, "stop_sequences": list("abcd")}
    assert httpx.post(f"{server.url}/v1/messages", json=four, timeout=60).status_code == 200


EMPTY_BLOCK = [{"type": "text", "text": ""}]
NOT_EMPTY = (
    "all messages must have non-empty content except for the optional final assistant message"
)
EMPTY_TEXT = "text content blocks must be non-empty"
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
EMPTY_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": EMPTY_BLOCK}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"messages": [{"role": "user", "content": ""}]},
            f"messages.0: {NOT_EMPTY}",
            id="user-empty-string",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": []}]},
            f"messages.0: {NOT_EMPTY}",
            id="user-no-blocks",
        ),
        pytest.param(
            {"messages": [HI, {"role": "assistant", "content": ""}, HI]},
            f"messages.1: {NOT_EMPTY}",
            id="earlier-assistant-empty-string",
        ),
        pytest.param(
            {"messages": [HI, {"role": "assistant", "content": []}, HI]},
            f"messages.1: {NOT_EMPTY}",
            id="earlier-assistant-no-blocks",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": EMPTY_BLOCK}]},
            f"messages.0.content.0.text: {EMPTY_TEXT}",
            id="user-empty-text-block",
        ),
        pytest.param(  # a final assistant message may be empty, not hold an empty block
            {"messages": [HI, {"role": "assistant", "content": EMPTY_BLOCK}]},
            f"messages.1.content.0.text: {EMPTY_TEXT}",
            id="final-assistant-empty-text-block",
        ),
        pytest.param({"system": EMPTY_BLOCK}, f"system.0.text: {EMPTY_TEXT}", id="system-block"),
        pytest.param(
            {
                "messages": [
                    HI,
                    {"role": "assistant", "content": [CALL]},
                    {"role": "user", "content": [EMPTY_RESULT]},
                ]
            },
            f"messages.2.content.0.content.0.text: {EMPTY_TEXT}",
            id="tool-result-empty-text-block",
        ),
    ],
)
def test_empty_content_is_refused_as_anthropic_refuses_it(
    server: RunningServer, change: dict[str, Any], message: str
) -> None:
    """Anthropic's own refusals of empty content, in its words, led by the field: on the
    message route and on count_tokens (which reads the same prompt)."""
    body: dict[str, Any] = {"model": MODEL, "messages": [HI], **change}
    for path, extra in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
        response = httpx.post(f"{server.url}{path}", json={**body, **extra}, timeout=60)
        assert anthropic_error(response, 400, "invalid_request_error") == message, path


@pytest.mark.parametrize("empty", ["", []], ids=["empty-string", "no-blocks"])
def test_an_empty_final_assistant_message_is_no_prefill(claude: Any, empty: Any) -> None:
    """Anthropic takes an empty final assistant message: it adds nothing to the prompt."""
    alone = claude.messages.count_tokens(model=MODEL, messages=[HI])
    with_it = claude.messages.count_tokens(
        model=MODEL, messages=[HI, {"role": "assistant", "content": empty}]
    )
    assert with_it.input_tokens == alone.input_tokens
    message = claude.messages.create(
        model=MODEL, max_tokens=4, messages=[HI, {"role": "assistant", "content": empty}]
    )
    assert message.usage.input_tokens == alone.input_tokens


def test_the_sdk_raises_its_own_classes(claude: Any) -> None:
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(
            model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}]
        )
    assert "max_tokens" in bad.value.body["error"]["message"]


def test_x_api_key_is_the_key(keyed_server: RunningServer) -> None:
    import anthropic

    models = httpx.get(f"{keyed_server.url}/v1/models", headers={"x-api-key": "sk-test-key"})
    model = models.json()["data"][0]["id"]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    with anthropic.Anthropic(
        base_url=keyed_server.url, api_key="sk-test-key", max_retries=0, timeout=60
    ) as good:
        assert good.messages.count_tokens(**body).input_tokens > 0
    with (
        anthropic.Anthropic(
            base_url=keyed_server.url, api_key="wrong", max_retries=0, timeout=60
        ) as wrong,
        pytest.raises(anthropic.AuthenticationError) as refused,
    ):
        wrong.messages.count_tokens(**body)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_docs_messages_examples_run(server: RunningServer) -> None:
    """The curl and `anthropic` SDK examples of docs/anthropic.md, as written."""
    curl, snippet = section_examples("Anthropic Messages API", page="anthropic.md")
    reply = json.loads(run_example(server.url, "bash", curl))
    assert reply["type"] == "message" and reply["content"][0]["text"].strip()
    name, rest = run_example(server.url, "python", snippet).split(maxsplit=1)
    city, reason = rest.rsplit(maxsplit=1)
    assert (name, reason) == ("get_weather", "tool_use") and city.strip()
