"""How much one /v1/completions or /v1/completions/render request may ask for, over real HTTP
on the default model: its prompts times n within --max-prompts-per-request, refused alike by
both routes before any prompt is prepared; a render's answer within 4 x --max-body-bytes; and a
render at the limit answered while /health stays answered."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from config import ServerConfig
from tests.support.server_harness import RunningServer, assert_openai_error, wait_until_idle

MODEL = "SmolLM2-135M-Instruct"
ROUTES = ["/v1/completions", "/v1/completions/render"]
LIMIT = 8  # the limited server's --max-prompts-per-request
SMALL_BODY = 1024  # the small server's --max-body-bytes: its render answers take at most 4 KiB
# A /health that takes longer than this is an event loop held by one request (on this machine
# it answers in a fraction of a second while the big render below runs).
HEALTH_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def limited(default_engine: Any) -> Any:
    running = RunningServer(
        default_engine, ServerConfig(served_model_name=[MODEL], max_prompts_per_request=LIMIT)
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def small_body(default_engine: Any) -> Any:
    running = RunningServer(
        default_engine, ServerConfig(served_model_name=[MODEL], max_body_bytes=SMALL_BODY)
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


def test_a_render_answer_larger_than_its_limit_is_refused(small_body: RunningServer) -> None:
    """Each rendered prompt carries its sampling parameters: a few one-token prompts fit the
    small server's 4 KiB of answer, enough of them (in a body of a few bytes) do not."""
    one = post(small_body, "/v1/completions/render", {"prompt": [[1]], "max_tokens": 1})
    assert one.status_code == 200, one.text
    item = len(one.content)
    fits = post(small_body, "/v1/completions/render", {"prompt": [[1]] * 2, "max_tokens": 1})
    assert fits.status_code == 200 and len(fits.json()) == 2
    too_many = 4 * SMALL_BODY // item + 2
    refused = post(small_body, "/v1/completions/render", {"prompt": [[1]] * too_many})
    assert refused.status_code == 400, refused.text[:300]
    error = assert_openai_error(refused.json())
    assert (error["param"], error["code"]) == ("prompt", "response_too_large")
    assert f"limit of {4 * SMALL_BODY} bytes (4 x --max-body-bytes)" in error["message"]


def test_health_answers_while_a_render_at_the_limit_runs(server: RunningServer) -> None:
    """2048 prompts of 1900 token ids (a 7.8 MB body, within the 8 MiB limit): every prompt's
    checks and the 9 MB answer once held the event loop for seconds; now /health is answered
    all along, and the render still answers every prompt."""
    prompts = [[(i + j) % 9 + 1 for j in range(1900)] for i in range(2048)]
    result: dict[str, httpx.Response] = {}

    def render() -> None:
        result["render"] = post(
            server, "/v1/completions/render", {"prompt": prompts, "max_tokens": 1}
        )

    thread = threading.Thread(target=render)
    thread.start()
    answered = 0
    try:
        with httpx.Client(base_url=server.url, timeout=HEALTH_TIMEOUT) as health:
            while thread.is_alive():
                try:
                    status = health.get("/health").status_code
                except httpx.TimeoutException:
                    pytest.fail(
                        f"/health got no answer within {HEALTH_TIMEOUT} s during the render"
                    )
                assert status == 200
                answered += 1
    finally:
        thread.join(120)
    response = result["render"]
    assert response.status_code == 200, response.text[:300]
    rendered = response.json()
    assert [r["token_ids"] for r in rendered] == prompts
    assert answered >= 3  # the probes ran while the render did
