"""Hostile request bodies, sent as raw bytes over real HTTP: malformed JSON, wrong JSON types,
huge and negative numbers, NaN and Infinity, invalid UTF-8 and lone surrogates, bodies nested
100,000 levels deep, bodies over the size limit (declared and chunked), wrong content types,
methods and routes.

Each row of the table says what the server must answer: the status code and, for errors,
exactly OpenAI's error object `{"error": {"message", "type", "param", "code"}}` with the type and
parameter to blame. None may be a 5xx, a hang or FastAPI's own 422 body. After the whole table
the server still answers a normal request and the engine holds no request and no KV block.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from config import ServerConfig
from tests.support.server_harness import (
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    RunningServer,
    assert_openai_error,
    start_tiny_server,
    wait_until_idle,
)

VOCAB = 128257  # the Llama-3.2 tokenizer's, checked against the engine by the fixture
BODY_LIMIT = ServerConfig().max_body_bytes
TIMEOUT = 60.0  # seconds; no row may take longer (a hang fails instead of blocking the run)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
CHAT_HI = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
JSON_TYPE = {"content-type": "application/json"}

# --------------------------------------------------------------------------- the table

ANY = object()  # a param the row does not pin down


@dataclass(frozen=True)
class Row:
    name: str
    body: bytes
    status: int
    type: str | None = "invalid_request_error"  # None: a success, no error object
    param: object = ANY
    code: str | None = None
    method: str = "POST"
    path: str = COMPLETIONS
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_TYPE))
    chunked: bool = False  # send the body with Transfer-Encoding: chunked, no Content-Length
    words: tuple[str, ...] = ()  # what the error message must say


def raw(text: str) -> bytes:
    return text.encode()


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields: Any) -> bytes:
    """A valid completion request (two tokens, greedy) with `fields` added or replaced."""
    return body(**{"prompt": "Hello", "max_tokens": 2, "temperature": 0, **fields})


def chat(**fields: Any) -> bytes:
    return body(
        **{
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
            **fields,
        }
    )


def bad(name: str, content: bytes, param: object = ANY, path: str = COMPLETIONS, **kw: Any) -> Row:
    """A row answered 400 invalid_request_error."""
    return Row(name, content, 400, param=param, path=path, **kw)


def nested(depth: int, leaf: str = '"x"') -> str:
    return "[" * depth + leaf + "]" * depth


NOT_JSON = ("not valid JSON",)
MALFORMED = [
    bad("json-truncated", raw('{"prompt": "Hello", "max_tokens": '), None, words=NOT_JSON),
    bad("json-trailing-comma", raw('{"prompt": "Hello",}'), None, words=NOT_JSON),
    bad("json-single-quotes", raw("{'prompt': 'Hello'}"), None, words=NOT_JSON),
    bad("json-unquoted-key", raw('{prompt: "Hello"}'), None, words=NOT_JSON),
    bad("json-two-objects", raw('{"prompt": "Hello"}{"prompt": "Bye"}'), None, words=NOT_JSON),
    bad("json-bare-word", raw("Hello"), None, words=NOT_JSON),
    bad("json-whitespace-only", raw(" \n\t "), None, words=NOT_JSON),
    bad("json-comment", raw('{"prompt": "Hello" /* hi */}'), None, words=NOT_JSON),
    bad("empty-body", b"", None, words=("empty",)),
    bad("empty-body-chat", b"", None, CHAT, words=("empty",)),
    bad("body-array", raw('[{"prompt": "Hello"}]'), None, words=("JSON object", "an array")),
    bad("body-string", raw('"Hello"'), None, words=("JSON object", "a string")),
    bad("body-number", raw("42"), None, words=("JSON object", "a number")),
    bad("body-null", raw("null"), None, words=("JSON object", "null")),
    bad("body-true", raw("true"), None, words=("JSON object", "a boolean")),
    bad("body-array-chat", raw("[]"), None, CHAT, words=("JSON object", "an array")),
]

WRONG_TYPES = [
    bad("prompt-number", body(prompt=42), "prompt"),
    bad("prompt-object", body(prompt={"text": "Hello"}), "prompt"),
    bad("prompt-bool", body(prompt=True), "prompt"),
    bad("prompt-null", body(prompt=None), "prompt"),
    bad("prompt-list-of-bools", body(prompt=[True, False]), "prompt.0"),
    bad("max_tokens-numeric-string", completion(max_tokens="16"), "max_tokens"),
    bad("max_tokens-word", completion(max_tokens="lots"), "max_tokens"),
    bad("max_tokens-float", completion(max_tokens=1.5), "max_tokens"),
    bad("max_tokens-bool", completion(max_tokens=True), "max_tokens"),
    # A whole float is an integer to JSON Schema, and so to the server's published schema.
    Row("max_tokens-whole-float", completion(max_tokens=2.0), 200, None),
    Row("token-ids-whole-floats", completion(prompt=[1.0, 2.0], n=2.0), 200, None),
    bad("temperature-numeric-string", completion(temperature="0.5"), "temperature"),
    bad("temperature-word", completion(temperature="hot"), "temperature"),
    bad("n-list", completion(n=[2]), "n"),
    bad("n-bool", completion(n=True), "n"),
    bad("stream-word", completion(stream="yes"), "stream"),
    bad("echo-number", completion(echo=1), "echo"),
    bad("stop-number", completion(stop=5), "stop"),
    bad("stop-list-of-numbers", completion(stop=[1, 2]), "stop.0"),
    bad("logit_bias-list", completion(logit_bias=[1, 2]), "logit_bias"),
    bad("logit_bias-string-value", completion(logit_bias={"1": "high"}), "logit_bias.1"),
    bad("model-number", completion(model=7), "model"),
    bad("messages-string", chat(messages="Hi"), "messages", CHAT),
    bad("messages-object", chat(messages={"role": "user", "content": "Hi"}), "messages", CHAT),
    bad("message-not-object", chat(messages=["Hi"]), "messages.0", CHAT),
    bad(
        "message-content-number",
        chat(messages=[{"role": "user", "content": 5}]),
        "messages.0.content",
        CHAT,
    ),
    bad(
        "message-role-number",
        chat(messages=[{"role": 5, "content": "Hi"}]),
        "messages.0.role",
        CHAT,
    ),
    bad(
        "message-content-part-number",
        chat(messages=[{"role": "user", "content": [5]}]),
        "messages.0.content.0",
        CHAT,
    ),
]

HUGE_AND_NEGATIVE = [
    bad(
        "max_tokens-1e30",
        completion(max_tokens=10**30),
        "max_tokens",
        code="context_length_exceeded",
    ),
    bad(
        "max_tokens-5000-digits",
        raw('{"prompt": "Hello", "max_tokens": 1' + "0" * 5000 + "}"),
        None,
        words=(*NOT_JSON, "digits"),
    ),
    bad("max_tokens-1e400", raw('{"prompt": "Hello", "max_tokens": 1e400}'), "max_tokens"),
    bad("n-1e20", completion(n=10**20), "n"),
    bad("seed-2**64", completion(seed=2**64), "seed"),
    bad("logit_bias-1e308", completion(logit_bias={"1": 1e308}), "logit_bias"),
    bad("temperature-1e308", completion(temperature=1e308), "temperature"),
    bad("temperature-1e400", raw('{"prompt": "Hello", "temperature": 1e400}'), "temperature"),
    bad("token-id-2**64", completion(prompt=[1, 2**64]), "prompt.1"),
    bad("max_tokens-negative", completion(max_tokens=-1), "max_tokens"),
    bad("n-negative", completion(n=-1), "n"),
    bad("top_k-negative", completion(top_k=-2), "top_k"),
    bad("logprobs-negative", completion(logprobs=-1), "logprobs"),
    bad("seed-below-int64", completion(seed=-(2**63) - 1), "seed"),
    bad("token-id-negative", completion(prompt=[1, -5]), "prompt.1"),
    bad("token-id-negative-in-batch", completion(prompt=[[1], [2, -5]]), "prompt.1.1"),
    bad("stop_token_id-negative", completion(stop_token_ids=[-5]), "stop_token_ids.0"),
    bad(
        "max_completion_tokens-negative",
        chat(max_completion_tokens=-1),
        "max_completion_tokens",
        CHAT,
    ),
]

NON_FINITE = [
    bad("temperature-NaN", raw('{"prompt": "Hello", "temperature": NaN}'), "temperature"),
    bad(
        "temperature-NaN-chat",
        raw('{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'),
        "temperature",
        CHAT,
    ),
    bad("top_p-Infinity", raw('{"prompt": "Hello", "top_p": Infinity}'), "top_p"),
    bad("top_p-minus-Infinity", raw('{"prompt": "Hello", "top_p": -Infinity}'), "top_p"),
    bad("min_p-NaN", raw('{"prompt": "Hello", "min_p": NaN}'), "min_p"),
    bad(
        "presence_penalty-NaN",
        raw('{"prompt": "Hello", "presence_penalty": NaN}'),
        "presence_penalty",
    ),
    bad(
        "frequency_penalty-Infinity",
        raw('{"prompt": "Hello", "frequency_penalty": Infinity}'),
        "frequency_penalty",
    ),
    bad(
        "repetition_penalty-Infinity",
        raw('{"prompt": "Hello", "repetition_penalty": Infinity}'),
        "repetition_penalty",
    ),
    bad(
        "logit_bias-NaN",
        raw('{"prompt": "Hello", "logit_bias": {"1": NaN}}'),
        "logit_bias.1",
        words=("finite",),
    ),
    bad(
        "logit_bias-Infinity-chat",
        raw('{"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"1": -Infinity}}'),
        "logit_bias.1",
        CHAT,
    ),
    bad("max_tokens-NaN", raw('{"prompt": "Hello", "max_tokens": NaN}'), "max_tokens"),
    bad("seed-Infinity", raw('{"prompt": "Hello", "seed": Infinity}'), "seed"),
    bad("token-id-NaN", raw('{"prompt": [1, NaN]}'), "prompt.1", words=("integer", "NaN")),
]

ENCODING = [
    bad("utf8-invalid-ff-fe", b'{"prompt": "\xff\xfe"}', None, words=(*NOT_JSON, "UTF-8")),
    bad("utf8-invalid-continuation", b'{"prompt": "\xc3\x28"}', None, words=(*NOT_JSON, "UTF-8")),
    bad("utf8-overlong", b'{"prompt": "\xc0\xaf"}', None, words=(*NOT_JSON, "UTF-8")),
    bad(
        "utf8-invalid-chat",
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
        None,
        CHAT,
        words=("UTF-8",),
    ),
    # A surrogate encoded as UTF-8 bytes: Python's json decodes it (surrogatepass) to a lone surrogate.
    bad(
        "utf8-encoded-surrogate-chat",
        b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        "messages.0.content",
        CHAT,
        words=("surrogate",),
    ),
    # Valid JSON escapes that are no text: a lone surrogate cannot be tokenized, nor sent back.
    bad(
        "lone-surrogate-prompt", raw('{"prompt": "Hello \\ud800"}'), "prompt", words=("surrogate",)
    ),
    bad(
        "lone-surrogate-prompt-batch",
        raw('{"prompt": ["Hello", "\\udc00"]}'),
        "prompt.1",
        words=("surrogate",),
    ),
    bad(
        "lone-surrogate-chat",
        raw('{"messages": [{"role": "user", "content": "Hi \\udfff"}]}'),
        "messages.0.content",
        CHAT,
    ),
    bad(
        "lone-surrogate-role",
        raw('{"messages": [{"role": "\\ud800", "content": "Hi"}]}'),
        "messages.0.role",
        CHAT,
    ),
    bad("lone-surrogate-stop", raw('{"prompt": "Hello", "stop": ["\\ud800"]}'), "stop.0"),
    bad("lone-surrogate-tokenize", raw('{"prompt": "\\ud800"}'), "prompt", path="/tokenize"),
    # Reported back in the error: written out as its escape, so that the body stays UTF-8.
    Row(
        "lone-surrogate-model",
        raw('{"prompt": "Hello", "model": "\\ud800"}'),
        404,
        param="model",
        code="model_not_found",
        words=("\\ud800",),
    ),
    # A lone surrogate in a key lands in the error's location, which must still render.
    bad(
        "lone-surrogate-in-param",
        raw('{"prompt": "Hello", "logit_bias": {"\\ud800": "high"}}'),
        ANY,
    ),
    Row("nul-characters", completion(prompt="Hel\u0000lo\u0000"), 200, None),
    # Strings nothing tokenizes, reported by where they are: ids, names, items a store keeps.
    bad("lone-surrogate-user-chat", raw(CHAT_HI[:-1] + ', "user": "\\ud800"}'), "user", CHAT),
    bad("lone-surrogate-user", raw('{"prompt": "Hello", "user": "\\udfff"}'), "user"),
    bad(
        "lone-surrogate-tool-name",
        raw(CHAT_HI[:-1] + ', "tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}'),
        "tools.0.function.name",
        CHAT,
    ),
    bad(
        "lone-surrogate-metadata-key",
        raw(CHAT_HI[:-1] + ', "metadata": {"\\ud800": "x"}}'),
        "metadata",
        CHAT,
    ),
    bad(
        "lone-surrogate-previous-response-id",
        raw('{"input": "Hi", "previous_response_id": "resp_\\ud800"}'),
        "previous_response_id",
        RESPONSES,
        words=("surrogate",),
    ),
    bad(
        "lone-surrogate-responses-user",
        raw('{"input": "Hi", "user": "\\ud800"}'),
        "user",
        RESPONSES,
    ),
    bad(
        "lone-surrogate-input-item-id",
        raw('{"input": [{"role": "user", "content": "Hi", "id": "msg_\\ud800"}]}'),
        "input.0.id",
        RESPONSES,
    ),
    bad(
        "lone-surrogate-instructions",
        raw('{"input": "Hi", "instructions": "\\udc00"}'),
        "instructions",
        RESPONSES,
    ),
    bad(
        "role-a-list",
        raw('{"input": [{"role": ["user"], "content": "Hi"}]}'),
        "input.0.role",
        RESPONSES,
    ),
    bad(
        "role-an-object",
        raw('{"input": [{"role": {"user": 1}, "content": "Hi"}]}'),
        "input.0.role",
        RESPONSES,
    ),
]

TOO_DEEP = (*NOT_JSON, "nested too deeply")
DEEP = [
    bad("prompt-nested-100000", raw('{"prompt": ' + nested(100_000) + "}"), None, words=TOO_DEEP),
    bad(
        "content-nested-10000",
        raw('{"messages": [{"role": "user", "content": ' + nested(10_000) + "}]}"),
        None,
        CHAT,
        words=TOO_DEEP,
    ),
    bad(
        "object-nested-100000",
        raw('{"prompt": "Hello", "x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}"),
        None,
        words=TOO_DEEP,
    ),
    # Just inside the parser's depth limit: the schema refuses what it gets, at the right place.
    bad(
        "content-nested-900",
        raw('{"messages": [{"role": "user", "content": ' + nested(900) + "}]}"),
        "messages.0.content.0",
        CHAT,
    ),
    bad("prompt-nested-900", raw('{"prompt": ' + nested(900) + "}"), "prompt.0.0"),
    # Deep junk in an unknown field is accepted, as unknown fields are; it must not crash.
    Row(
        "extra-field-nested-900",
        raw('{"prompt": "Hello", "max_tokens": 2, "x": ' + nested(900) + "}"),
        200,
        None,
    ),
    Row(
        "message-extra-field-nested-200",
        raw(
            '{"messages": [{"role": "user", "content": "Hi", "x": '
            + nested(200)
            + '}], "max_tokens": 2}'
        ),
        200,
        None,
        path=CHAT,
    ),
    # A message's other fields go to the chat template, which gives up on this depth: its error.
    bad(
        "message-extra-field-nested-900",
        raw(
            '{"messages": [{"role": "user", "content": "Hi", "x": '
            + nested(900)
            + '}], "max_tokens": 2}'
        ),
        "messages",
        CHAT,
    ),
]

PADDING = b"x" * (10 * 1024 * 1024)  # a 10 MiB body: over the limit
SIZE = [
    Row(
        "body-10MiB",
        b'{"prompt": "Hello", "max_tokens": 1, "padding": "' + PADDING + b'"}',
        413,
        param=None,
    ),
    Row(
        "body-10MiB-chunked",
        b'{"prompt": "Hello", "max_tokens": 1, "padding": "' + PADDING + b'"}',
        413,
        param=None,
        chunked=True,
    ),
    Row(
        "body-10MiB-chat",
        b'{"messages": [{"role": "user", "content": "' + PADDING + b'"}]}',
        413,
        param=None,
        path=CHAT,
    ),
]

MODELS_AND_ROUTES = [
    Row(
        "unknown-model",
        completion(model="gpt-nonexistent"),
        404,
        param="model",
        code="model_not_found",
    ),
    Row(
        "unknown-model-chat",
        chat(model="gpt-nonexistent"),
        404,
        param="model",
        code="model_not_found",
        path=CHAT,
    ),
    Row(
        "unknown-model-100k-chars",
        completion(model="m" * 100_000),
        404,
        param="model",
        code="model_not_found",
    ),
    Row("get-on-completions", b"", 405, method="GET", param=None),
    Row("get-on-chat", b"", 405, method="GET", path=CHAT, param=None),
    Row("put-on-chat", chat(), 405, method="PUT", path=CHAT, param=None),
    Row("unknown-route", completion(), 404, path="/v1/complete", param=None),
    Row("unknown-route-root", b"", 404, method="GET", path="/nowhere", param=None),
]

# A body that is not declared as JSON is refused, not guessed at: FastAPI hands the route the raw
# bytes, and the server says that the body must be JSON (OpenAI's clients always declare it).
JSON_ONLY = ("must be JSON", "Content-Type: application/json")
CONTENT_TYPES = [
    bad(
        "content-type-text-plain",
        completion(),
        None,
        headers={"content-type": "text/plain"},
        words=(*JSON_ONLY, "text/plain"),
    ),
    bad(
        "content-type-form",
        completion(),
        None,
        headers={"content-type": "application/x-www-form-urlencoded"},
        words=(*JSON_ONLY, "x-www-form-urlencoded"),
    ),
    bad(
        "content-type-form-pairs",
        raw("prompt=Hello&max_tokens=2"),
        None,
        headers={"content-type": "application/x-www-form-urlencoded"},
        words=JSON_ONLY,
    ),
    bad(
        "content-type-multipart",
        completion(),
        None,
        headers={"content-type": "multipart/form-data; boundary=x"},
        words=JSON_ONLY,
    ),
    bad(
        "content-type-missing",
        completion(),
        None,
        headers={},
        words=(*JSON_ONLY, "no Content-Type"),
    ),
    bad(
        "content-type-text-plain-chat",
        chat(),
        None,
        CHAT,
        headers={"content-type": "text/plain"},
        words=JSON_ONLY,
    ),
    Row(
        "content-type-json-charset",
        completion(),
        200,
        None,
        headers={"content-type": "application/json; charset=utf-8"},
    ),
    Row(
        "content-type-json-suffix",
        completion(),
        200,
        None,
        headers={"content-type": "application/vnd.api+json"},
    ),
]

CHAT_SEMANTICS = [
    bad("messages-empty", chat(messages=[]), "messages", CHAT),
    bad("message-without-role", chat(messages=[{"content": "Hi"}]), "messages.0.role", CHAT),
    # Roles are not a closed set here (as in vLLM): the chat template decides, and this one
    # renders any role, so an unknown role is answered.
    Row(
        "message-unknown-role",
        chat(messages=[{"role": "wizard", "content": "Hi"}]),
        200,
        None,
        path=CHAT,
    ),
    bad(
        "content-part-image",
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        "messages.0.content.0",
        CHAT,
    ),
]

TOKENS = [
    bad("token-id-vocab-size", completion(prompt=[1, VOCAB]), "prompt"),
    bad("token-id-1e9", completion(prompt=[1, 10**9]), "prompt"),
    bad("token-id-int64-max", completion(prompt=[2**63 - 1]), "prompt"),
    bad("token-id-beyond-vocab-in-batch", completion(prompt=[[1, 2], [VOCAB + 7]]), "prompt"),
    bad("stop_token_id-beyond-vocab", completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
    bad("logit_bias-beyond-vocab", completion(logit_bias={str(VOCAB): 1}), "logit_bias"),
    bad("detokenize-beyond-vocab", body(tokens=[1, VOCAB]), "tokens", "/detokenize"),
    bad(
        "prompt-beyond-context",
        completion(prompt=[1] * (MAX_MODEL_LEN + 1), max_tokens=1),
        "prompt",
        code="context_length_exceeded",
    ),
    bad("prompt-empty-batch", completion(prompt=[[]]), "prompt"),
    # The last of 500 prompts is refused: none of the 499 before it may have reached the engine.
    bad(
        "token-id-beyond-vocab-late-in-batch",
        completion(prompt=[[1, 2]] * 499 + [[VOCAB]]),
        "prompt",
    ),
]

ROWS = (
    MALFORMED
    + WRONG_TYPES
    + HUGE_AND_NEGATIVE
    + NON_FINITE
    + ENCODING
    + DEEP
    + SIZE
    + MODELS_AND_ROUTES
    + CONTENT_TYPES
)
ROWS += CHAT_SEMANTICS + TOKENS


# --------------------------------------------------------------------------- fixtures and tests


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    engine, running = start_tiny_server(llama_dir, tmp_path_factory.mktemp("chat-tokenizer"))
    try:
        assert engine.engine.vocab_size == VOCAB, (
            "the token-id rows assume the Llama-3.2 vocabulary"
        )
        yield running
    finally:
        running.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def http(served: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as c:
        yield c


def send(http: httpx.Client, row: Row) -> httpx.Response:
    if not row.chunked:
        return http.request(row.method, row.path, content=row.body, headers=row.headers)
    chunk = 64 * 1024

    def pieces() -> Iterator[bytes]:
        for start in range(0, len(row.body), chunk):
            yield row.body[start : start + chunk]

    response = http.request(row.method, row.path, content=pieces(), headers=row.headers)
    # The body really went without a length, so only counting it can catch it.
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    return response


def test_rows_are_distinct() -> None:
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names)), "two rows share a name"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_hostile_input(http: httpx.Client, row: Row) -> None:
    response = send(http, row)
    assert response.status_code == row.status, response.text[:1000]
    if row.type is None:  # answered: a real completion, not an error in disguise
        assert response.json()["choices"], response.text[:1000]
        return
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = assert_openai_error(response.json())
    assert error["type"] == row.type, error
    if row.param is not ANY:
        assert error["param"] == row.param, error
    assert error["code"] == row.code, error
    for word in row.words:
        assert word in error["message"], (word, error["message"])


# Every string a route takes, in one full body per route: each is replaced in turn by odd text.
FULL_BODIES: dict[str, dict[str, Any]] = {
    COMPLETIONS: {
        "prompt": ["Hello", "there"],
        "max_tokens": 2,
        "stop": ["\n", "END"],
        "user": "u-1",
        "guided_regex": "[a-z]+",
        "metadata": {"k": "v"},
    },
    CHAT: {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
        ],
        "max_tokens": 2,
        "stop": "END",
        "user": "u-1",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "the weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "tool_choice": "none",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": {"type": "object", "title": "t"}},
        },
    },
    RESPONSES: {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": "Hi", "id": "msg_1"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "max_output_tokens": 2,
        "user": "u-1",
        "metadata": {"k": "v"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": "none",
    },
    "/tokenize": {"prompt": "Hello"},
}
ODD_TEXT = ["\ud800", "a\udfffb", "\x00\x01\x1f\x7f", "\u202e\ufeff\uffff"]


def string_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, str):
        yield path
    elif isinstance(node, dict):
        for key, child in node.items():
            yield from string_paths(child, (*path, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from string_paths(child, (*path, i))


def replaced(node: Any, path: tuple[Any, ...], value: str) -> Any:
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    copy[path[0]] = replaced(node[path[0]], path[1:], value)
    return copy


@pytest.mark.parametrize("route", list(FULL_BODIES))
def test_odd_text_in_any_string_field_is_never_a_server_error(
    http: httpx.Client, route: str
) -> None:
    """Lone surrogates (sent as JSON escapes) and control characters in every string field of
    every generating route: an answer or a 400, never a 5xx, a hang or a non-JSON error."""
    full = FULL_BODIES[route]
    given = http.post(route, json=full)
    assert given.status_code == 200, given.text  # the body as given is served
    for path in string_paths(full):
        for odd in ODD_TEXT:
            body = json.dumps(replaced(full, path, odd)).encode()  # ASCII: \ud800 as an escape
            response = http.post(route, content=body, headers=JSON_TYPE)
            where = ".".join(map(str, path))
            assert response.status_code < 500, (where, odd, response.text[:500])
            if response.status_code >= 400:
                assert_openai_error(response.json())


def test_still_serving_after_the_table(served: RunningServer, http: httpx.Client) -> None:
    response = http.post(
        COMPLETIONS, content=completion(max_tokens=4, ignore_eos=True), headers=JSON_TYPE
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (
        choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 4
    )
    state = wait_until_idle(served.engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0), state
    assert state.free_blocks == state.num_blocks == NUM_KV_BLOCKS, state
