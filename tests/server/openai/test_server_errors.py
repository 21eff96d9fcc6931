"""Every error the server returns, over real HTTP: the status code, OpenAI's exact error object
`{"error": {"message", "type", "param", "code"}}` (never FastAPI's 422 `{"detail": ...}`), the
parameter to blame, and the exception class the official openai client raises for it. Covers
out-of-range and wrongly typed parameters, empty and oversized prompts, token ids outside the
vocabulary, bad JSON, unknown models, routes and methods, API keys and CORS; and shows that
after all of them the server still answers and the engine holds no request and no KV block."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from tests.support.server_harness import RunningServer, wait_until_idle

JSON = dict[str, Any]

MODEL = "smol"
MAX_MODEL_LEN = 8192
VOCAB = 49152
MAX_NUM_SEQS = 64  # tests/conftest.py SERVER_SETTINGS
API_KEY = "sk-test-key"
ORIGIN = "http://dashboard.example"

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say hi."}]
BASE = {
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 4},
    CHAT: {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
}
GOOD = {
    "model": MODEL,
    "prompt": "The capital of France is",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}
ERROR_KEYS = {"message", "type", "param", "code"}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module", autouse=True)
def reference(server: RunningServer) -> list[str]:
    """A greedy answer taken before any bad request, to compare with the one taken after all."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        response = c.post(COMPLETIONS, json=GOOD)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


def error_of(response: httpx.Response, status: int) -> JSON:
    """The inner error object, after checking the status and that the body is exactly
    OpenAI's shape: one top-level key, the four error keys, a non-empty message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"], body  # not {"detail": [...]}, FastAPI's 422 body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"].strip()
    assert isinstance(error["type"], str) and error["type"]
    return error


def sdk_post(
    client: openai.OpenAI, path: str, body: JSON | None = None, content: bytes | None = None
) -> object:
    """POST through the openai client, which maps the status to its exception class."""
    route = path.removeprefix("/v1")
    if content is not None:
        return client.post(
            route,
            cast_to=object,
            content=content,
            options={"headers": {"Content-Type": "application/json"}},
        )
    return client.post(route, cast_to=object, body=body)


def assert_sdk_raises(
    call: Any, exc_class: type[openai.APIStatusError], status: int, error: JSON
) -> None:
    """The client raises exactly `exc_class`, carrying the same error object the raw body had."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert type(info.value) is exc_class
    assert info.value.status_code == status
    assert info.value.body == error  # the SDK keeps the inner error object
    assert (info.value.type, info.value.param, info.value.code) == (
        error["type"],
        error["param"],
        error["code"],
    )


@dataclass(frozen=True)
class Bad:
    """A request answered with 400: the parameter to blame and words its message must hold."""

    name: str
    path: str
    fields: JSON
    param: str | None
    words: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()  # base fields the request leaves out

    def body(self) -> JSON:
        base = {k: v for k, v in BASE[self.path].items() if k not in self.drop}
        return {**base, **self.fields}


def both(name: str, fields: JSON, param: str | None, *words: str) -> list[Bad]:
    return [
        Bad(f"{name}-completions", COMPLETIONS, fields, param, words),
        Bad(f"{name}-chat", CHAT, fields, param, words),
    ]


# --------------------------------------------------------------------------- 400: bad parameters

OUT_OF_RANGE = [
    *both("temperature-negative", {"temperature": -0.1}, "temperature", "-0.1", "0"),
    *both("temperature-high", {"temperature": 2.5}, "temperature", "2.5", "2"),
    *both("top_p-zero", {"top_p": 0}, "top_p", "greater than 0"),
    *both("top_p-high", {"top_p": 1.5}, "top_p", "1.5"),
    *both("n-zero", {"n": 0}, "n", "greater than or equal to 1"),
    *both("n-129", {"n": 129}, "n", "128", "129"),
    # Within the API's range but above the engine's max_num_seqs: refused by the engine's check.
    *both("n-over-max-num-seqs", {"n": 100}, "n", f"n=100 exceeds max_num_seqs={MAX_NUM_SEQS}"),
    Bad("logprobs-6", COMPLETIONS, {"logprobs": 6}, "logprobs", ("5", "6")),
    Bad(
        "top_logprobs-21",
        CHAT,
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        ("20", "21"),
    ),
    Bad(
        "top_logprobs-without-logprobs",
        CHAT,
        {"top_logprobs": 3},
        "top_logprobs",
        ("requires logprobs",),
    ),
    *both(
        "stop-five-strings",
        {"stop": ["a", "b", "c", "d", "e"]},
        "stop",
        "stop: at most 4 stop sequences, got 5",
    ),
    *both("presence_penalty-high", {"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    *both("presence_penalty-low", {"presence_penalty": -2.5}, "presence_penalty", "-2.5"),
    *both("frequency_penalty-high", {"frequency_penalty": 2.5}, "frequency_penalty", "2.5"),
    *both("frequency_penalty-low", {"frequency_penalty": -2.5}, "frequency_penalty", "-2.5"),
    *both("seed-2**63", {"seed": 2**63}, "seed", str(2**63)),
    *both("seed-below-int64", {"seed": -(2**63) - 1}, "seed", str(-(2**63) - 1)),
    *both("max_tokens-zero", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    *both("max_tokens-negative", {"max_tokens": -5}, "max_tokens", "-5"),
    Bad(
        "max_completion_tokens-zero",
        CHAT,
        {"max_completion_tokens": 0},
        "max_completion_tokens",
        ("1",),
    ),
    *both("logit_bias-101", {"logit_bias": {"42": 101}}, "logit_bias", "[-100, 100]"),
    *both("logit_bias-word-key", {"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
    *both("logit_bias-float-key", {"logit_bias": {"1.5": 5}}, "logit_bias", "token ids"),
    *both(
        "logit_bias-key-outside-vocab", {"logit_bias": {str(VOCAB): 5}}, "logit_bias", str(VOCAB)
    ),
    *both(
        "stream_options-without-stream",
        {"stream_options": {"include_usage": True}},
        "stream_options",
        "stream",
    ),
    *both(
        "stream_options-stream-false",
        {"stream": False, "stream_options": {"include_usage": True}},
        "stream_options",
        "stream",
    ),
    *both("best_of-above-n", {"best_of": 2}, "best_of", "best_of=2", "n (1)"),
    *both("best_of-below-n", {"n": 3, "best_of": 2}, "best_of", "best_of=2", "n (3)"),
    *both("best_of-zero", {"best_of": 0}, "best_of", "best_of=0"),
    Bad(
        "tools-completions",
        COMPLETIONS,
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        "tools",
        ("tools",),
    ),
    # Chat takes tools with "auto" (the default choice) on this model with no tool flag, in the
    # generic format; only a constraint that is no JSON cannot join its grammar.
    Bad(
        "tools-chat-auto-with-a-regex",
        CHAT,
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "guided_regex": "[a-z]+",
        },
        "guided_regex",
        ("tool_choice", "auto", "--tool-call-parser"),
    ),
]

WRONG_TYPES = [
    Bad("prompt-number", COMPLETIONS, {"prompt": 42}, "prompt", ("42",)),
    Bad("prompt-object", COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt"),
    Bad("prompt-missing", COMPLETIONS, {}, "prompt", ("required",), drop=("prompt",)),
    Bad("messages-string", CHAT, {"messages": "hello"}, "messages", ("list", "hello")),
    Bad("messages-missing", CHAT, {}, "messages", ("required",), drop=("messages",)),
    Bad(
        "message-without-role",
        CHAT,
        {"messages": [{"content": "hi"}]},
        "messages.0.role",
        ("required",),
    ),
    *both("temperature-word", {"temperature": "hot"}, "temperature", "number", "hot"),
    *both("n-float", {"n": 1.5}, "n", "integer", "1.5"),
    *both("stream-word", {"stream": "sometimes"}, "stream", "boolean"),
    *both("best_of-string", {"best_of": "1"}, "best_of", "integer"),
    # Junk nested inside known fields is refused, at the deepest field that names it.
    *both("stop-nested-junk", {"stop": {"a": [1, {"b": None}]}}, "stop"),
    *both("stop-list-of-lists", {"stop": [["a"]]}, "stop.0", "string"),
    *both(
        "stream_options-nested-junk",
        {"stream": True, "stream_options": {"include_usage": {"deep": [1]}}},
        "stream_options.include_usage",
        "boolean",
    ),
    *both(
        "continuous_usage_stats-word",
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "y"}},
        "stream_options.continuous_usage_stats",
        "boolean",
    ),
    *both("logit_bias-nested-junk", {"logit_bias": {"42": {"x": 1}}}, "logit_bias.42", "number"),
    Bad(
        "content-part-without-type",
        CHAT,
        {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "messages.0.content.0.type",
        ("required",),
    ),
    Bad(
        "content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"
    ),
]

EMPTY_AND_TOKENS = [
    Bad("prompt-empty-string", COMPLETIONS, {"prompt": ""}, "prompt", ("empty",)),
    Bad("prompt-empty-list", COMPLETIONS, {"prompt": []}, "prompt", ("empty",)),
    Bad(
        "prompt-batch-with-empty-string",
        COMPLETIONS,
        {"prompt": ["Hello", ""]},
        "prompt",
        ("empty",),
    ),
    Bad("prompt-batch-with-empty-ids", COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt", ("empty",)),
    Bad("messages-empty", CHAT, {"messages": []}, "messages", ("at least 1",)),
    Bad(
        "token-id-vocab-size",
        COMPLETIONS,
        {"prompt": [1, VOCAB]},
        "prompt",
        (str(VOCAB), f"[0, {VOCAB})"),
    ),
    Bad(
        "token-id-in-batch",
        COMPLETIONS,
        {"prompt": [[1, 2], [3, VOCAB + 7]]},
        "prompt",
        (str(VOCAB + 7),),
    ),
    # A negative id is refused by the request schema, at its position in the prompt.
    Bad(
        "token-id-negative",
        COMPLETIONS,
        {"prompt": [1, -1]},
        "prompt.1",
        ("-1", "greater than or equal to 0"),
    ),
    Bad(
        "token-id-negative-in-batch", COMPLETIONS, {"prompt": [[1, 2], [-5]]}, "prompt.1.0", ("-5",)
    ),
    Bad("token-id-not-int", COMPLETIONS, {"prompt": [[1, "x"]]}, "prompt.0.1", ("integer",)),
    Bad(
        "prompt-batch-with-number",
        COMPLETIONS,
        {"prompt": ["Hello", 3]},
        "prompt.1",
        ("string", "3"),
    ),
    *both("stop_token_ids-negative", {"stop_token_ids": [-3]}, "stop_token_ids.0", "-3"),
    *both(
        "stop_token_ids-outside-vocab", {"stop_token_ids": [VOCAB]}, "stop_token_ids", str(VOCAB)
    ),
    Bad(
        "content-part-image",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
                    ],
                }
            ]
        },
        "messages.0.content.0",
        ("reads no images",),
    ),
    Bad(
        "content-part-second-image",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                    ],
                },
            ]
        },
        "messages.1.content.1",
        ("reads no images",),
    ),
    Bad(
        "response_format-json-schema-without-schema",
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        ("json_schema.schema",),
    ),
    Bad("suffix", COMPLETIONS, {"suffix": "end"}, "suffix", ("suffix",)),
    # The test server schedules first come, first served: a priority would mean nothing.
    Bad("priority-fcfs", CHAT, {"priority": 1}, "priority", ("--scheduling-policy priority",)),
    Bad("priority-fcfs-completion", COMPLETIONS, {"priority": -3}, "priority", ("priority",)),
]


@pytest.mark.parametrize(
    "case", OUT_OF_RANGE + WRONG_TYPES + EMPTY_AND_TOKENS, ids=lambda c: c.name
)
def test_bad_request(http: httpx.Client, client: openai.OpenAI, case: Bad) -> None:
    body = case.body()
    error = error_of(http.post(case.path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.param
    assert error["code"] is None
    for word in case.words:
        assert word in error["message"], (word, error["message"])
    assert_sdk_raises(lambda: sdk_post(client, case.path, body), openai.BadRequestError, 400, error)


def test_tools_with_the_default_choice_need_no_flag(http: httpx.Client) -> None:
    """The request that once needed --tool-call-parser: tools with no tool_choice ("auto")."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    response = http.post(CHAT, json={**BASE[CHAT], "tools": tools, "max_tokens": 30})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    calls = choice["message"].get("tool_calls") or []
    if calls:
        assert [c["function"]["name"] for c in calls] == ["f"]
        assert choice["finish_reason"] == "tool_calls"
    else:
        assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")


def test_nan_temperature_is_refused(http: httpx.Client, client: openai.OpenAI) -> None:
    # Python's json accepts the bare NaN literal; the range check must still refuse it (a NaN
    # compares false to every bound) rather than let it reach the sampler.
    for path, base in (
        (COMPLETIONS, '"prompt": "Hello"'),
        (CHAT, '"messages": [{"role": "user", "content": "hi"}]'),
    ):
        raw = f'{{"model": "{MODEL}", {base}, "max_tokens": 4, "temperature": NaN}}'.encode()
        error = error_of(
            http.post(path, content=raw, headers={"content-type": "application/json"}), 400
        )
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "temperature",
            None,
        )
        assert "NaN" in error["message"]
        assert_sdk_raises(
            partial(sdk_post, client, path, content=raw), openai.BadRequestError, 400, error
        )


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "smol", "prompt": "Hello",',
        b"not json at all",
        b'{"model": "smol", "prompt": "Hello"}}',
        b"\xff\xfe",
    ],
    ids=["truncated", "text", "trailing-brace", "not-utf8"],
)
def test_malformed_json(http: httpx.Client, client: openai.OpenAI, raw: bytes) -> None:
    for path in (COMPLETIONS, CHAT):
        error = error_of(
            http.post(path, content=raw, headers={"content-type": "application/json"}), 400
        )
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            None,
            None,
        )
        assert "not valid JSON" in error["message"]
        assert_sdk_raises(
            partial(sdk_post, client, path, content=raw), openai.BadRequestError, 400, error
        )


@pytest.mark.parametrize(
    "raw", [b"[1, 2, 3]", b'"Hello"', b"null"], ids=["array", "string", "null"]
)
def test_body_not_an_object(http: httpx.Client, raw: bytes) -> None:
    for path in (COMPLETIONS, CHAT):
        error = error_of(
            http.post(path, content=raw, headers={"content-type": "application/json"}), 400
        )
        assert error["type"] == "invalid_request_error" and error["code"] is None


def test_unknown_top_level_fields_are_ignored(http: httpx.Client, reference: list[str]) -> None:
    # Unknown top-level fields, however deeply nested, are ignored (as vLLM does): the answer is
    # the same greedy text as without them.
    junk = {"x_junk": {"a": [1, {"b": [None, {"c": "d"}]}], "e": 1.5}, "metadata": {"k": "v"}}
    response = http.post(COMPLETIONS, json={**GOOD, **junk})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == reference


IGNORED = "The following fields were present in the request but ignored: "


def ignored_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(IGNORED)]


def test_unknown_top_level_fields_are_logged_once_by_name(
    http: httpx.Client, caplog: pytest.LogCaptureFixture, reference: list[str]
) -> None:
    """The server runs in this process, so its log is caplog's. Unknown fields are named once
    per request (not per prompt), at warning level, and the answer is the one without them."""
    caplog.set_level(logging.WARNING)
    caplog.clear()
    response = http.post(COMPLETIONS, json={**GOOD, "foo": 1, "bar": 2})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == reference
    (record,) = ignored_logs(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == IGNORED + "{'bar', 'foo'}"

    caplog.clear()
    body = {**BASE[CHAT], "foo": [1], "stream": True}
    assert http.post(CHAT, json=body).status_code == 200
    assert http.post(COMPLETIONS, json={**GOOD, "prompt": ["a", "b"], "bar": 0}).status_code == 200
    assert http.post("/tokenize", json={"prompt": "hi", "baz": None}).status_code == 200
    assert [r.getMessage() for r in ignored_logs(caplog)] == [
        IGNORED + "{'foo'}",
        IGNORED + "{'bar'}",
        IGNORED + "{'baz'}",
    ]

    # Known fields only, vLLM's and nested ones included: nothing is logged.
    caplog.clear()
    known = {
        **GOOD,
        "n": 2,
        "best_of": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "top_k": 5,
        "min_tokens": 1,
        "user": "u",
    }
    assert http.post(COMPLETIONS, json=known).status_code == 200
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "x"}]
    chat = {**BASE[CHAT], "messages": messages, "max_completion_tokens": 2, "logprobs": True}
    assert http.post(CHAT, json=chat).status_code == 200
    assert ignored_logs(caplog) == []


def test_a_client_cannot_flood_the_log_with_field_names(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Names are cut short and escaped (a newline in one cannot forge a log line), and at most
    20 of them are listed."""
    caplog.set_level(logging.WARNING)
    caplog.clear()
    junk = {f"{i:03d}\n" + "x" * 500: i for i in range(100)}
    assert http.post(COMPLETIONS, json={**GOOD, **junk}).status_code == 200
    (record,) = ignored_logs(caplog)
    message = record.getMessage()
    assert "\n" not in message and message.endswith(", ... (80 more)}")
    assert len(message) < 20 * 100 + 200


def test_best_of_equal_to_n_is_accepted(
    http: httpx.Client, client: openai.OpenAI, reference: list[str]
) -> None:
    """best_of = n asks for nothing beyond the n samples, so it is served as without it; any
    other value is refused (test_bad_request), through the SDK too."""
    response = http.post(COMPLETIONS, json={**GOOD, "best_of": 1})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == reference
    sdk_good = {k: v for k, v in GOOD.items() if k != "ignore_eos"}
    extra = {"extra_body": {"ignore_eos": True}}
    out = client.completions.create(**sdk_good, **extra, n=2, best_of=2)
    assert [c.text for c in out.choices] == reference * 2  # greedy: both samples alike
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"best_of": 1}
    )
    assert len(chat.choices) == 1

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**sdk_good, **extra, best_of=3)
    assert info.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, n=2, extra_body={"best_of": 4}
        )
    assert info.value.param == "best_of"


# --------------------------------------------------------------------------- context length


def tokenize(http: httpx.Client, **body: Any) -> list[int]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def too_long(prompt_len: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
        "Please reduce the length of the prompt or the completion."
    )


def test_prompt_plus_max_tokens_beyond_context(http: httpx.Client, client: openai.OpenAI) -> None:
    text_len = len(tokenize(http, prompt="Hello there, how are you?"))
    chat_len = len(tokenize(http, messages=MESSAGES))
    cases = [
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": "Hello there, how are you?", "max_tokens": MAX_MODEL_LEN},
            text_len,
            MAX_MODEL_LEN,
        ),
        # One token over: the budget check is not off by one.
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": [1] * 100, "max_tokens": MAX_MODEL_LEN - 99},
            100,
            MAX_MODEL_LEN - 99,
        ),
        (
            CHAT,
            {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN},
            chat_len,
            MAX_MODEL_LEN,
        ),
        (
            CHAT,
            {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 9000},
            chat_len,
            9000,
        ),
    ]
    for path, body, prompt_len, max_tokens in cases:
        error = error_of(http.post(path, json=body), 400)
        assert error["message"] == too_long(prompt_len, max_tokens)
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        )
        assert_sdk_raises(partial(sdk_post, client, path, body), openai.BadRequestError, 400, error)
    # Exactly max_model_len is accepted; a bias toward the end-of-sequence token (id 2) ends
    # the answer at once, so the full budget is never generated.
    eos_now = {"temperature": 0, "logit_bias": {"2": 100}}
    fits = [
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": [1] * 100, "max_tokens": MAX_MODEL_LEN - 100, **eos_now},
        ),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": MESSAGES,
                "max_tokens": MAX_MODEL_LEN - chat_len,
                **eos_now,
            },
        ),
    ]
    for path, body in fits:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "stop"


def test_prompt_alone_beyond_context(http: httpx.Client, client: openai.OpenAI) -> None:
    long_chat = [{"role": "user", "content": "hi " * 9000}]
    chat_len = len(tokenize(http, messages=long_chat))
    assert chat_len > MAX_MODEL_LEN
    cases = [
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": [1] * 8200},
            8200,
            16,
            "prompt",
        ),  # max_tokens defaults to 16
        (COMPLETIONS, {"model": MODEL, "prompt": [1] * 8200, "max_tokens": 1}, 8200, 1, "prompt"),
        # A prompt of exactly max_model_len leaves no room for even one token.
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1},
            MAX_MODEL_LEN,
            1,
            "prompt",
        ),
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": [[1, 2], [1] * 8200], "max_tokens": 1},
            8200,
            1,
            "prompt",
        ),
        # Unasked, the chat budget is the room left, of which there is none.
        (CHAT, {"model": MODEL, "messages": long_chat}, chat_len, 1, "messages"),
    ]
    for path, body, prompt_len, max_tokens, param in cases:
        error = error_of(http.post(path, json=body), 400)
        assert error["message"] == too_long(prompt_len, max_tokens)
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            param,
            "context_length_exceeded",
        )
        assert_sdk_raises(partial(sdk_post, client, path, body), openai.BadRequestError, 400, error)


# --------------------------------------------------------------------------- 404, 405


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model(http: httpx.Client, client: openai.OpenAI, path: str) -> None:
    body = {**BASE[path], "model": "gpt-nonexistent"}
    error = error_of(http.post(path, json=body), 404)
    assert error == {
        "message": "The model 'gpt-nonexistent' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert_sdk_raises(partial(sdk_post, client, path, body), openai.NotFoundError, 404, error)


def test_unknown_model_card(http: httpx.Client, client: openai.OpenAI) -> None:
    error = error_of(http.get("/v1/models/gpt-nonexistent"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert_sdk_raises(
        lambda: client.models.retrieve("gpt-nonexistent"), openai.NotFoundError, 404, error
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/nope"),
        ("GET", "/v1/nope"),
        ("GET", "/nowhere/at/all"),
        ("POST", "/v1/completion"),
    ],
)
def test_unknown_route(http: httpx.Client, client: openai.OpenAI, method: str, path: str) -> None:
    error = error_of(http.request(method, path, json={}), 404)
    assert error == {
        "message": f"Invalid URL ({method} {path})",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    if path.startswith("/v1/") and method == "POST":
        assert_sdk_raises(lambda: sdk_post(client, path, {}), openai.NotFoundError, 404, error)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", COMPLETIONS),
        ("GET", CHAT),
        ("DELETE", COMPLETIONS),
        ("PUT", CHAT),
        ("POST", "/v1/models"),
    ],
)
def test_wrong_method(http: httpx.Client, client: openai.OpenAI, method: str, path: str) -> None:
    response = http.request(method, path)
    error = error_of(response, 405)
    assert error == {
        "message": "Method Not Allowed",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert response.headers["allow"] == ("GET" if path == "/v1/models" else "POST")
    if method == "GET":
        # 405 has no class of its own in the SDK: the base status error, exactly.
        assert_sdk_raises(
            lambda: client.get(path.removeprefix("/v1"), cast_to=object),
            openai.APIStatusError,
            405,
            error,
        )


# --------------------------------------------------------------------------- API key, CORS


@pytest.fixture(scope="module")
def keyed_http(keyed_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def keyed_model(keyed_http: httpx.Client) -> str:
    response = keyed_http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["data"][0]["id"]


def keyed_requests(model: str) -> list[tuple[str, str, JSON | None]]:
    return [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{model}", None),
        (
            "POST",
            COMPLETIONS,
            {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        ),
        ("POST", CHAT, {"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}),
        ("POST", "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2}),
    ]


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (
            None,
            "You didn't provide an API key: use 'Authorization: Bearer KEY' (or 'x-api-key: KEY').",
        ),
        ("Bearer sk-wrong", "Incorrect API key provided."),
        (API_KEY, "Incorrect API key provided."),  # the key without its Bearer scheme
        (f"Bearer {API_KEY}x", "Incorrect API key provided."),
    ],
    ids=["missing", "wrong", "no-scheme", "longer"],
)
def test_api_key_refused(
    keyed_http: httpx.Client, keyed_model: str, authorization: str | None, message: str
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path, body in keyed_requests(keyed_model):
        response = keyed_http.request(method, path, json=body, headers=headers)
        error = error_of(response, 401)
        assert error == {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        assert response.headers["www-authenticate"] == "Bearer"


def test_api_key_accepted(
    keyed_http: httpx.Client, keyed_model: str, keyed_server: RunningServer
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, body in keyed_requests(keyed_model):
        response = keyed_http.request(method, path, json=body, headers=headers)
        assert response.status_code == 200, response.text
    with openai.OpenAI(
        base_url=keyed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    ) as sdk:
        assert [m.id for m in sdk.models.list().data] == [keyed_model]
        out = sdk.completions.create(model=keyed_model, prompt="Hello", max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 2
        chat = sdk.chat.completions.create(
            model=keyed_model, messages=MESSAGES, max_tokens=2, temperature=0
        )  # type: ignore[arg-type]
        assert chat.choices[0].message.role == "assistant"


def test_sdk_with_wrong_key(keyed_server: RunningServer, keyed_model: str) -> None:
    with openai.OpenAI(
        base_url=keyed_server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=120
    ) as sdk:
        calls = [
            lambda: sdk.models.list(),
            lambda: sdk.completions.create(model=keyed_model, prompt="Hello", max_tokens=2),
            lambda: sdk.chat.completions.create(model=keyed_model, messages=MESSAGES, max_tokens=2),  # type: ignore[arg-type]
            lambda: sdk.responses.create(model=keyed_model, input="Hello", max_output_tokens=2),
            lambda: sdk.responses.retrieve("resp_any"),
            lambda: sdk.responses.input_items.list("resp_any"),
            lambda: sdk.responses.delete("resp_any"),
        ]
        error = {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        for call in calls:
            assert_sdk_raises(call, openai.AuthenticationError, 401, error)


def test_open_routes_need_no_key(keyed_http: httpx.Client) -> None:
    assert keyed_http.get("/health").status_code == 200
    metrics = keyed_http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    version = keyed_http.get("/version")
    assert version.status_code == 200 and list(version.json()) == ["version"]


def test_cors_preflight(keyed_http: httpx.Client) -> None:
    # A browser's preflight carries no key and must be answered before the key is asked for.
    for path in (COMPLETIONS, CHAT, "/v1/models"):
        response = keyed_http.options(
            path,
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in response.headers["access-control-allow-methods"]
        allowed_headers = response.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_cors_disallowed_origin(keyed_http: httpx.Client, keyed_model: str) -> None:
    preflight = keyed_http.options(
        COMPLETIONS,
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    # A request from an unlisted origin is served (CORS binds browsers only) but not opened to it.
    body = {"model": keyed_model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = keyed_http.post(
        COMPLETIONS, json=body, headers={**auth, "Origin": "http://evil.example"}
    )
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    allowed = keyed_http.post(COMPLETIONS, json=body, headers={**auth, "Origin": ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN


def test_cors_headers_on_errors(keyed_http: httpx.Client) -> None:
    # A dashboard must be able to read why it was refused: the 401 carries the CORS header too.
    response = keyed_http.get("/v1/models", headers={"Origin": ORIGIN})
    error_of(response, 401)
    assert response.headers["access-control-allow-origin"] == ORIGIN


# --------------------------------------------------------------------------- afterwards


def test_server_still_serves_and_engine_is_empty(
    http: httpx.Client, client: openai.OpenAI, default_engine: AsyncEngine, reference: list[str]
) -> None:
    # Runs last in this module: none of the refused requests broke the server or left a
    # request or a KV block behind in the engine.
    assert http.get("/health").status_code == 200
    out = client.completions.create(
        model=MODEL,
        prompt=GOOD["prompt"],
        max_tokens=GOOD["max_tokens"],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in out.choices] == reference
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == GOOD["max_tokens"]
    state = wait_until_idle(default_engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0)
    assert state.free_blocks == state.num_blocks
