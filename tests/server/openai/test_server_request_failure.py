"""A request the engine fails alone is answered with OpenAI's 500 error object (whole) or an
error event (streamed), while a request running beside it gets exactly its answer, and the
server goes on: /health is 200, the engine holds nothing, and /metrics counts the failure as
finished_reason="error". The failure is injected into the engine's text-making step for
requests whose prompt starts with MARK; the rest runs as it does in production."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

import engine.llm_engine as llm_engine_module
from tests.support.server_harness import (
    RunningServer,
    assert_openai_error,
    scrape,
    value,
    wait_until_idle,
)

MARK = [2, 3, 5, 7, 11, 13]
OTHER = {"prompt": "The capital of France is", "n": 2, "temperature": 0, "max_tokens": 12}


@pytest.fixture
def failing_marked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    update = llm_engine_module.update_texts

    def update_or_fail(seq: Any, text: Any, token_ids: list[int]) -> int:
        if seq.prompt_token_ids[: len(MARK)] == MARK and seq.num_output_tokens >= 2:
            raise RuntimeError("injected")
        return update(seq, text, token_ids)

    monkeypatch.setattr(llm_engine_module, "update_texts", update_or_fail)
    yield


def _marked(stream: bool) -> dict[str, Any]:
    return {"model": "smol", "prompt": [*MARK, 17, 19], "max_tokens": 8, "stream": stream}


def test_a_failed_request_is_a_500_and_its_neighbour_is_exact(
    server: RunningServer, client: openai.OpenAI, failing_marked: None
) -> None:
    alone = client.completions.create(model="smol", **OTHER)
    before = scrape(server.url)
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(client.completions.create, model="smol", **OTHER)
        response = httpx.post(server.url + "/v1/completions", json=_marked(False), timeout=60)
        other = beside.result(timeout=120)

    assert response.status_code == 500
    error = assert_openai_error(response.json())
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert [c.text for c in other.choices] == [c.text for c in alone.choices]

    # A streamed one: its events so far, then an error event, then [DONE].
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=_marked(True), timeout=60
    ) as streamed:
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert assert_openai_error(last)["type"] == "server_error"
    assert all("error" not in json.loads(e) for e in events[:-2])

    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks
    after = scrape(server.url)
    failures = "request_success_total"
    assert (
        value(after, failures, finished_reason="error")
        - value(before, failures, finished_reason="error")
        == 2
    )
