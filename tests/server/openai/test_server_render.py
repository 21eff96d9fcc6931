"""vLLM's render routes over real HTTP on the default model: the prompt tokens and sampling
parameters a chat or completion request would run with, nothing generated or queued, and the
same 400s as the routes themselves."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.support.server_harness import RunningServer, wait_until_idle

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def http(server: RunningServer):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_chat_render_is_the_prompt_the_chat_route_runs(
    http: httpx.Client, client: openai.OpenAI, server: RunningServer
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 7, "temperature": 0}
    rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200, rendered.text
    out = rendered.json()
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    assert out["token_ids"] == tokens
    params = out["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["n"]) == (7, 0.0, 1)
    assert out["model"] == MODEL and out["priority"] == 0 and out["features"] is None
    assert out["request_id"].startswith("chatcmpl-")
    state = wait_until_idle(server.engine)
    assert (state.requests, state.free_blocks) == (0, state.num_blocks)  # nothing was queued
    completion = client.chat.completions.create(**body)
    assert completion.usage.prompt_tokens == len(out["token_ids"])


def test_chat_render_carries_the_grammar_and_tools_it_would_use(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    out = http.post("/v1/chat/completions/render", json=body).json()
    assert set(out["sampling_params"]["structured_outputs"]) == {"json"}


def test_completion_render_gives_one_request_per_prompt(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": ["Hello there", "Good morning"], "max_tokens": 5}
    out = http.post("/v1/completions/render", json=body).json()
    assert len(out) == 2
    for prompt, rendered in zip(body["prompt"], out):
        encoded = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
        assert rendered["token_ids"] == encoded["tokens"]
    ids = http.post("/v1/completions/render", json={**body, "prompt": [[1, 2, 3]]}).json()
    assert [r["token_ids"] for r in ids] == [[1, 2, 3]]
    assert [o["sampling_params"]["max_tokens"] for o in out] == [5, 5]
    assert out[0]["request_id"] != out[1]["request_id"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 5}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**9}),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}),
        ("/v1/completions", {"prompt": "hi", "priority": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "model": "no-such-model"}),
    ],
)
def test_render_answers_bad_bodies_as_its_route(
    http: httpx.Client, route: str, body: dict[str, Any]
) -> None:
    body = {"model": MODEL, **body}
    direct, rendered = http.post(route, json=body), http.post(route + "/render", json=body)
    assert direct.status_code >= 400
    assert (rendered.status_code, rendered.json()) == (direct.status_code, direct.json())
