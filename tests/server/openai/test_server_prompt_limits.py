"""How much one /v1/completions or /v1/completions/render request may ask for, over real HTTP
on the default model: its prompts times n within --max-prompts-per-request, refused alike by
both routes before any prompt is prepared."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from config import ServerConfig
from tests.support.server_harness import RunningServer, assert_openai_error, wait_until_idle

MODEL = "SmolLM2-135M-Instruct"
ROUTES = ["/v1/completions", "/v1/completions/render"]
LIMIT = 8  # the limited server's --max-prompts-per-request


@pytest.fixture(scope="module")
def limited(default_engine: Any) -> Any:
    running = RunningServer(
        default_engine, ServerConfig(served_model_name=[MODEL], max_prompts_per_request=LIMIT)
    )
    yield running
    running.stop()


def post(server: RunningServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("route", ROUTES)
def test_a_hundred_thousand_prompts_are_refused_naming_the_limit(
    server: RunningServer, route: str
) -> None:
    """A 0.5 MB body of 100000 one-token prompts: a 400 naming the flag, not a 67 MB answer."""
    response = post(server, route, {"prompt": [[1]] * 100_000, "max_tokens": 1})
    assert response.status_code == 400, response.text[:300]
    error = assert_openai_error(response.json())
    assert error["param"] == "prompt"
    assert error["message"] == (
        "the request holds 100000 prompts, more than this server's limit of 2048 "
        "(--max-prompts-per-request)"
    )
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks  # nothing was queued


@pytest.mark.parametrize("route", ROUTES)
def test_prompts_at_the_limit_are_served_one_more_refused(
    limited: RunningServer, route: str
) -> None:
    prompts = [f"Count to {i}:" for i in range(LIMIT)]
    served = post(limited, route, {"prompt": prompts, "max_tokens": 1})
    assert served.status_code == 200, served.text
    out = served.json()
    items = out if route.endswith("/render") else out["choices"]
    assert len(items) == LIMIT
    refused = post(limited, route, {"prompt": [*prompts, "One more:"], "max_tokens": 1})
    assert refused.status_code == 400
    error = assert_openai_error(refused.json())
    assert error["param"] == "prompt"
    assert "9 prompts" in error["message"] and "--max-prompts-per-request" in error["message"]


def test_prompts_times_n_count_against_the_limit(limited: RunningServer) -> None:
    """Each prompt's n samples are completions of their own: 4 prompts with n=2 fit a limit of
    8, with n=3 they do not; the route and its render refuse them alike."""
    body: dict[str, Any] = {"prompt": ["a", "b", "c", "d"], "max_tokens": 1, "n": 2}
    served = post(limited, "/v1/completions", body)
    assert served.status_code == 200, served.text
    assert len(served.json()["choices"]) == 8
    direct, rendered = (post(limited, route, {**body, "n": 3}) for route in ROUTES)
    assert (direct.status_code, rendered.status_code) == (400, 400)
    assert direct.json() == rendered.json()
    error = assert_openai_error(direct.json())
    assert error["param"] == "n"
    assert error["message"].startswith(
        "4 prompts with n=3 ask for 12 completions, more than this server's limit of 8"
    )
    wait_until_idle(limited.engine)
