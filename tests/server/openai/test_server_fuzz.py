"""Property-based fuzzing of every route in the server's own /openapi.json, over real HTTP.

schemathesis generates requests from the published schema: valid ones (positive mode) and ones
that break it (negative mode: wrong types, out-of-range numbers, missing fields, junk bodies).
For every generated request the server must answer without a 5xx, and every 4xx body must be
exactly OpenAI's error object `{"error": {"message", "type", "param", "code"}}` (Anthropic's
`{"type": "error", "error": {"type", "message"}}` on its Messages routes), never FastAPI's 422
`{"detail": ...}`. Afterwards the engine holds no request and every KV block is free.

The engine runs a tiny random-weight Llama with a 64-token context, so that even the largest
valid request (n=64 samples of the whole context) finishes in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import BaseSchema

from engine.async_engine import AsyncEngine
from tests.support.server_harness import (
    NUM_KV_BLOCKS,
    RunningServer,
    assert_openai_error,
    start_tiny_server,
    wait_until_idle,
)

EXAMPLES_PER_ROUTE = 40  # per generation mode
REQUEST_TIMEOUT = 60.0  # seconds; a request that takes longer is a hang, not a slow answer

# Every route the schema must publish: a route added without being listed here fails
# `test_schema_lists_every_route`, so that nothing escapes the fuzzer unnoticed.
BODY_ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/v1/completions/render"),
    # A chat model's server answers these with a 400 naming --runner pooling; the fuzzer checks
    # that their validation, too, never ends in a 5xx or a body of another shape.
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/score"),
    ("POST", "/score"),
    ("POST", "/v1/rerank"),
    ("POST", "/rerank"),
    ("POST", "/v2/rerank"),
]
# No body and no parameter that could be of a wrong type (a path segment is always a string):
# only valid requests exist, so the negative mode has nothing to generate.
PLAIN_ROUTES = [
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("DELETE", "/v1/responses/{response_id}"),
]


@dataclass
class Served:
    engine: AsyncEngine
    server: RunningServer
    schema: BaseSchema


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    engine, running = start_tiny_server(llama_dir, tmp_path_factory.mktemp("chat-tokenizer"))
    try:
        yield Served(engine, running, schemathesis.openapi.from_url(running.url + "/openapi.json"))
    finally:
        running.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def assert_anthropic_error(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def openai_error_body(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    """Every 4xx is JSON holding exactly OpenAI's error object (Anthropic's on its routes)."""
    if not 400 <= response.status_code < 500:
        return
    content_type = (response.headers.get("content-type") or [""])[0]
    assert content_type.startswith("application/json"), (
        f"{response.status_code} with content-type {content_type!r}"
    )
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(
            f"{response.status_code} body is not JSON: {response.content[:200]!r}"
        ) from None
    if case is not None and case.operation.path.startswith("/v1/messages"):
        assert_anthropic_error(body)
    else:
        assert_openai_error(body)


CHECKS = [not_a_server_error, openai_error_body]


def fuzz(
    served: Served, session: requests.Session, method: str, path: str, mode: GenerationMode
) -> None:
    operation = served.schema[path][method]

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        derandomize=True,  # the same examples on every run: a failure here is reproducible
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: its time is unbounded
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(session=session, checks=CHECKS, timeout=REQUEST_TIMEOUT)

    run()
    # Whatever was sent, nothing is left in the engine once the answers are in.
    state = wait_until_idle(served.engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0), state
    assert state.free_blocks == state.num_blocks, state


def verdict(status: int, content: bytes, content_type: str = "application/json") -> None:
    """The error check on a canned response, as schemathesis would hand it over (no server)."""
    request = requests.Request("POST", "http://127.0.0.1/v1/completions").prepare()
    response = schemathesis.Response(
        status, {"content-type": [content_type]}, content, request, elapsed=0.0, verify=False
    )
    openai_error_body(
        cast(Any, None), response, cast(Any, None)
    )  # the check reads neither context nor case


@pytest.mark.parametrize(
    ("status", "content", "content_type"),
    [
        (
            400,
            b'{"detail": [{"loc": ["body"], "msg": "Field required", "type": "missing"}]}',
            "application/json",
        ),
        (
            422,
            b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null}}',
            "application/json",
        ),
        (
            400,
            b'{"error": {"message": "", "type": "invalid_request_error", "param": null, "code": null}}',
            "application/json",
        ),
        (
            404,
            b'{"error": {"message": "x", "type": "t", "param": null, "code": null}, "detail": "x"}',
            "application/json",
        ),
        (
            400,
            b'{"error": {"message": "x", "type": "t", "param": 3, "code": null}}',
            "application/json",
        ),
        (413, b"<html>Request Entity Too Large</html>", "text/html"),
        (400, b"not json", "application/json"),
    ],
    ids=[
        "fastapi-detail",
        "no-code",
        "empty-message",
        "extra-key",
        "param-number",
        "html",
        "not-json",
    ],
)
def test_error_check_refuses_other_shapes(status: int, content: bytes, content_type: str) -> None:
    # The fuzzer's own check fails on every body that is not OpenAI's error object.
    with pytest.raises(AssertionError):
        verdict(status, content, content_type)


def test_error_check_accepts_openai_errors() -> None:
    verdict(
        400,
        b'{"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": null}}',
    )
    verdict(
        404,
        b'{"error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}',
    )
    verdict(500, b"<html>crash</html>", "text/html")  # a 5xx is not_a_server_error's to refuse


def test_schema_lists_every_route(served: Served) -> None:
    published = {
        (op.method.upper(), op.path) for op in (r.ok() for r in served.schema.get_all_operations())
    }
    assert published == set(BODY_ROUTES + PLAIN_ROUTES)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=lambda v: v)
def test_fuzz_route(
    served: Served, session: requests.Session, method: str, path: str, mode: GenerationMode
) -> None:
    fuzz(served, session, method, path, mode)


@pytest.mark.parametrize(("method", "path"), PLAIN_ROUTES, ids=lambda v: v)
def test_fuzz_plain_route(
    served: Served, session: requests.Session, method: str, path: str
) -> None:
    fuzz(served, session, method, path, GenerationMode.POSITIVE)


def test_engine_idle_after_fuzzing(served: Served) -> None:
    state = wait_until_idle(served.engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0), state
    assert state.free_blocks == state.num_blocks == NUM_KV_BLOCKS, state
