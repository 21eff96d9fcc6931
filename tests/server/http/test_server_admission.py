"""Admission and the drain, on a real server over HTTP on 127.0.0.1 (tiny random-weight Qwen3
with the real Qwen tokenizer and its chat template): a full queue refuses at once with 503 + Retry-After and
counts each refusal; each request limit is a 400 (413 for the body) naming its flag; a drain
lets requests in flight finish, refuses new ones, aborts what outlives --shutdown-timeout, and
leaves no engine or tokenizer thread behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from config import ServerConfig
from engine.async_engine import AsyncEngine
from server.app import attach_metrics
from tests.support.server_harness import (
    MODEL,
    RunningServer,
    Stream,
    assert_openai_error,
    scrape,
    start_engine,
    value,
    wait_until,
    wait_until_idle,
)

ENGINE_SETTINGS = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 8}


@contextmanager
def before_each_step(engine: AsyncEngine, hook: Callable[[], None]) -> Iterator[None]:
    """A test-only hook: `hook` runs on the engine thread before every step."""
    inner = engine.engine
    real_step = inner.step

    def hooked_step():  # type: ignore[no-untyped-def]
        hook()
        return real_step()

    inner.step = hooked_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        inner.step = real_step  # type: ignore[method-assign]


@contextmanager
def held_steps(engine: AsyncEngine) -> Iterator[threading.Event]:
    """Engine steps wait until the event is set, so requests stay queued."""
    release = threading.Event()
    with before_each_step(engine, lambda: release.wait(60)):
        try:
            yield release
        finally:
            release.set()


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    return assert_openai_error(response.json())


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_full_queue_refuses_at_once_with_retry_after_and_counts(qwen3_dir: Path) -> None:
    engine = start_engine(model=str(qwen3_dir), **ENGINE_SETTINGS)
    config = ServerConfig(served_model_name=[MODEL], max_waiting_requests=4)
    running = RunningServer(engine, config, attach_metrics(engine, config))
    gate = running.app.state.server.gate
    try:
        with held_steps(engine) as release:
            answers: list[httpx.Response] = []

            def send() -> None:
                answers.append(httpx.post(running.url + "/v1/completions", json=BODY, timeout=60))

            senders = [threading.Thread(target=send) for _ in range(4)]
            for sender in senders:
                sender.start()
            wait_until(
                lambda: gate.waiting,
                30,
                until=lambda waiting: waiting == 4,
                interval=0.02,
                what="4 requests waiting at the gate",
            )
            before = scrape(running.url)
            refused = [
                httpx.post(running.url + path, json=body, timeout=5)
                for path, body in (
                    ("/v1/completions", BODY),
                    (
                        "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    ),
                    ("/v1/completions", {**BODY, "stream": True}),
                )
            ]
            for response in refused:
                error = error_of(response, 503)
                assert response.headers["retry-after"] == "1"
                assert error["type"] == "service_unavailable" and error["code"] == "queue_full"
                assert "--max-waiting-requests" in str(error["message"])
            assert (
                httpx.get(running.url + "/health", timeout=5).status_code == 200
            )  # full is not unhealthy
            after = scrape(running.url)
            assert (
                value(after, "request_rejected_total", reason="queue_full")
                - value(before, "request_rejected_total", reason="queue_full")
                == 3
            )
            assert value(after, "request_rejected_total", reason="shutting_down") == 0
            release.set()
            for sender in senders:
                sender.join(60)
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json()["usage"]["completion_tokens"] == 6 for a in answers)
        wait_until(  # released once the last byte is out
            lambda: (gate.waiting, gate.in_flight),
            5,
            until=lambda counts: counts == (0, 0),
            interval=0.02,
            what="the gate to hold no request (waiting, in flight)",
        )
        assert httpx.post(running.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    finally:
        running.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def limited_server(qwen3_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(model=str(qwen3_dir), **ENGINE_SETTINGS)
    config = ServerConfig(max_n=2, max_output_tokens=8, max_prompt_tokens=16, max_body_bytes=4096)
    running = RunningServer(engine, config)
    yield running
    running.stop()
    engine.shutdown()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
LONG_PROMPT = list(range(5, 25))  # 20 tokens


@pytest.mark.parametrize(
    ("path", "body", "param", "flag"),
    [
        ("/v1/completions", {**BODY, "n": 3}, "n", "--max-n"),
        ("/v1/chat/completions", {**CHAT, "n": 3}, "n", "--max-n"),
        ("/v1/completions", {**BODY, "max_tokens": 9}, "max_tokens", "--max-output-tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 9},
            "max_tokens",
            "--max-output-tokens",
        ),
        ("/v1/completions", {**BODY, "prompt": LONG_PROMPT}, "prompt", "--max-prompt-tokens"),
        (
            "/v1/completions",
            {**BODY, "prompt": [[5], LONG_PROMPT]},
            "prompt",
            "--max-prompt-tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 30}]},
            "messages",
            "--max-prompt-tokens",
        ),
    ],
)
def test_limits_are_400_naming_their_flag(
    limited_server: RunningServer, path: str, body: dict, param: str, flag: str
) -> None:
    error = error_of(httpx.post(limited_server.url + path, json=body, timeout=30), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert flag in str(error["message"])


def test_unasked_max_tokens_is_capped_by_the_limit(limited_server: RunningServer) -> None:
    for path, body in (
        ("/v1/completions", {**BODY, "max_tokens": None}),
        ("/v1/chat/completions", {**CHAT, "ignore_eos": True}),
    ):
        answer = httpx.post(limited_server.url + path, json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8, (
            answer.text
        )


def test_body_over_the_limit_is_413_declared_or_chunked(limited_server: RunningServer) -> None:
    big = json.dumps({**BODY, "user": "x" * 5000}).encode()
    error = error_of(
        httpx.post(
            limited_server.url + "/v1/completions",
            content=big,
            headers={"content-type": "application/json"},
            timeout=30,
        ),
        413,
    )
    assert "--max-body-bytes" in str(error["message"]) and error["type"] == "invalid_request_error"

    async def chunked() -> httpx.Response:
        async def pieces():  # no Content-Length: the limit must be found while reading
            for start in range(0, len(big), 1000):
                yield big[start : start + 1000]

        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(
                limited_server.url + "/v1/completions",
                content=pieces(),
                headers={"content-type": "application/json"},
            )

    error = error_of(asyncio.run(chunked()), 413)
    assert "--max-body-bytes" in str(error["message"])
    fits = json.dumps({**BODY, "user": "x" * 3000}).encode()
    assert (
        httpx.post(
            limited_server.url + "/v1/completions",
            content=fits,
            headers={"content-type": "application/json"},
            timeout=60,
        ).status_code
        == 200
    )
    state = wait_until_idle(limited_server.engine)
    assert state.free_blocks == state.num_blocks


@pytest.mark.parametrize("timeout", [30.0, 1.0])
def test_drain_finishes_or_aborts_in_flight_and_refuses_new(
    qwen3_dir: Path, timeout: float
) -> None:
    """Two streams of 10 tokens and one of 240, at 30 ms a step (about 0.3 s and 7 s): a 30 s
    timeout lets all three finish; a 1 s timeout aborts the long one."""
    engine = start_engine(model=str(qwen3_dir), **ENGINE_SETTINGS)
    config = ServerConfig(served_model_name=[MODEL], shutdown_timeout=timeout)
    running = RunningServer(engine, config, attach_metrics(engine, config), lifecycle=True)
    state = running.app.state.server
    try:
        with before_each_step(engine, lambda: time.sleep(0.03)):
            streams = [
                Stream(running.url, {**BODY, "max_tokens": n}).start() for n in (10, 10, 240)
            ]
            wait_until(
                lambda: (state.gate.in_flight, state.gate.waiting),
                30,
                until=lambda counts: counts == (3, 0),
                interval=0.02,
                what="3 requests in flight and none waiting",
            )
            started = time.monotonic()
            running.drain()
            wait_until(
                lambda: state.gate.draining, 30, interval=0.02, what="the gate to be draining"
            )
            refused = httpx.post(running.url + "/v1/completions", json=BODY, timeout=5)
            assert error_of(refused, 503)["message"] == "the server is shutting down"
            assert (
                error_of(httpx.get(running.url + "/health", timeout=5), 503)["type"]
                == "service_unavailable"
            )
            assert value(scrape(running.url), "request_rejected_total", reason="shutting_down") == 1
            status = running.join(60)
            elapsed = time.monotonic() - started
            for stream in streams:
                stream.join(10)
    finally:
        running.stop()
        engine.shutdown()
    assert status == 0
    assert all(stream.error is None and stream.events[-1] == "[DONE]" for stream in streams)
    reasons = sorted(r for stream in streams for r in stream.finish_reasons)
    if timeout > 5:
        assert reasons == ["length"] * 3 and elapsed < timeout
    else:
        assert reasons == ["abort", "length", "length"] and elapsed >= timeout
        assert not engine.thread.is_alive()  # the drain stopped it to abort the long request
    with pytest.raises(RuntimeError):  # the app's tokenizer thread was shut down with it
        state.executor.submit(print)


def test_a_vanished_client_is_aborted_within_a_step(qwen3_dir: Path) -> None:
    """Steps of 50 ms; a client leaves mid-stream, another times out waiting for a whole answer:
    each request is gone from the engine within two steps of the close (the one running when
    the client left, then the next, which takes the abort)."""
    engine = start_engine(model=str(qwen3_dir), **ENGINE_SETTINGS)
    running = RunningServer(engine, ServerConfig())
    inner = engine.engine
    steps = {"n": 0}

    def count() -> None:
        time.sleep(0.05)
        steps["n"] += 1

    body = {**BODY, "max_tokens": 200}
    try:
        with before_each_step(engine, count):
            with httpx.stream(
                "POST", running.url + "/v1/completions", json={**body, "stream": True}, timeout=60
            ) as response:
                for i, _ in enumerate(response.iter_lines()):
                    if i == 6:
                        break
                closed_at = steps["n"]
            wait_until(
                lambda: not inner.requests,
                10,
                interval=0.02,
                what="the request to leave the engine",
            )
            assert steps["n"] - closed_at <= 2

            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    running.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5)
                )
            closed_at = steps["n"]
            wait_until(
                lambda: not inner.requests,
                10,
                interval=0.02,
                what="the request to leave the engine",
            )
            assert steps["n"] - closed_at <= 2
        state = wait_until_idle(engine)
        assert state.free_blocks == state.num_blocks
    finally:
        running.stop()
        engine.shutdown()


def test_a_request_without_a_token_within_max_queue_time_is_dropped(qwen3_dir: Path) -> None:
    engine = start_engine(model=str(qwen3_dir), **ENGINE_SETTINGS)
    config = ServerConfig(served_model_name=[MODEL], max_queue_time=0.5)
    running = RunningServer(engine, config, attach_metrics(engine, config))
    try:
        with held_steps(engine) as release:
            started = time.monotonic()
            error = error_of(
                httpx.post(running.url + "/v1/completions", json=BODY, timeout=30), 503
            )
            assert time.monotonic() - started >= 0.5
            assert error["code"] == "queue_timeout" and "--max-queue-time" in str(error["message"])
            stream = Stream(
                running.url, BODY
            ).start()  # the stream has begun: the error comes as an event
            stream.join(30)
            events = stream.events
            assert (
                stream.error is None
                and events[-1] == "[DONE]"
                and len(events) == 2
                and events[0]["error"]["code"] == "queue_timeout"
            )
            release.set()
            state = wait_until_idle(engine)
            assert (state.requests, state.free_blocks) == (0, state.num_blocks)  # both were aborted
        assert value(scrape(running.url), "request_rejected_total", reason="queue_timeout") == 2
        answer = httpx.post(running.url + "/v1/completions", json=BODY, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 6
        wait_until(
            lambda: running.app.state.server.gate.in_flight,
            5,
            until=lambda in_flight: in_flight == 0,
            interval=0.02,
            what="no request in flight at the gate",
        )
    finally:
        running.stop()
        engine.shutdown()
