"""The real daemon (`pagedserve serve` in a subprocess, HTTP on 127.0.0.1) stopping: SIGTERM
during load lets short requests finish, aborts long ones at --shutdown-timeout, refuses new
ones with 503 and exits 0 with no thread left; a second signal exits at once; an engine that
fails mid-step fails the requests in flight and makes the process exit 1, never hang."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.support.server_harness import Daemon, Stream, start_daemon, stop, wait_for_status


def test_sigterm_during_a_grammar_compile_exits_within_the_timeout(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """A schema of 3,000 optional properties compiles for minutes on its worker thread: the
    drain answers its request 503 at --shutdown-timeout, abandons the thread and exits 0."""
    # The limits that would refuse this schema, or give up on its compile, are lifted.
    limits = ["--max-schema-properties", "5000", "--grammar-compile-timeout", "600"]
    daemon = start_daemon(tmp_path, ["--shutdown-timeout", "2", *limits])
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    body = {
        "messages": [{"role": "user", "content": "Fill it in"}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "big", "schema": schema},
        },
    }
    answered: list[int] = []

    def send() -> None:
        try:
            answered.append(
                httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=120).status_code
            )
        except httpx.HTTPError:
            answered.append(0)  # the connection closed by the exiting server

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        time.sleep(3)  # well into the compile (the vocabulary read takes well under a second)
        assert not answered, "the schema compiled too fast to test an abandoned compile"
        signalled = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        assert time.monotonic() - signalled < 2 + 5  # the timeout, then less than uvicorn's grace
        sender.join(30)
        assert answered == [503]  # failed as the engine's requests are, not left to hang
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "stopped (exit status 0)" in log and "Traceback" not in log


def test_sigterm_under_load_drains_then_exits_0(tmp_path: Path, default_model_dir: Path) -> None:
    # 12 tokens take well under a second on an idle machine; the margin is for a loaded one.
    daemon = start_daemon(tmp_path, ["--num-kv-blocks", "512", "--shutdown-timeout", "10"])
    try:
        short = [
            Stream(
                daemon.url,
                {
                    "prompt": f"Count to {i}:",
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            for i in range(2)
        ]
        long = [
            Stream(
                daemon.url,
                {"prompt": f"Story {i}:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True},
            )
            for i in range(2)
        ]
        for stream in short + long:
            stream.start()
        for stream in short + long:
            assert stream.first_event.wait(60)
        signalled = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        wait_for_status(daemon.url + "/health", 503)
        refused = httpx.post(
            daemon.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10
        )
        assert refused.status_code == 503
        assert refused.json()["error"] == {
            "message": "the server is shutting down",
            "type": "service_unavailable",
            "param": None,
            "code": None,
        }
        assert daemon.wait(60) == 0
        elapsed = time.monotonic() - signalled
        for stream in short + long:
            stream.join(10)
            assert stream.error is None and stream.events[-1] == "[DONE]"
        assert [s.finish_reasons for s in short] == [["length"], ["length"]]
        assert [s.finish_reasons for s in long] == [["abort"], ["abort"]]
        assert all(sum(1 for e in s.events if isinstance(e, dict)) < 4000 for s in long)
        assert elapsed >= 10
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "aborting 2 requests in flight" in log and "stopped (exit status 0)" in log
    assert "threads still running" not in log and "Traceback" not in log


def test_a_progress_bar_leaves_no_thread_at_exit(tmp_path: Path, qwen3_dir: Path) -> None:
    """A first start converts the default model under tqdm's progress bars, which start tqdm's
    monitor thread: a clean stop still reports no thread left running."""
    daemon = start_daemon(
        tmp_path,
        [str(qwen3_dir), "--num-kv-blocks", "64", "--max-model-len", "256"],
        module="tests.support.serve_after_progress_bar",
    )
    try:
        assert "'tqdm_monitor'" in daemon.log.read_text()  # the monitor ran while serving
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "stopped (exit status 0)" in log
    assert "threads still running" not in log and "Traceback" not in log


def test_second_signal_exits_at_once(tmp_path: Path, default_model_dir: Path) -> None:
    daemon = start_daemon(tmp_path, ["--num-kv-blocks", "512", "--shutdown-timeout", "600"])
    try:
        long = Stream(
            daemon.url,
            {"prompt": "Story:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True},
        ).start()
        assert long.first_event.wait(60)
        daemon.process.send_signal(signal.SIGTERM)
        wait_for_status(daemon.url + "/health", 503)
        time.sleep(0.5)
        assert daemon.process.poll() is None  # still draining: the long request has 600 s
        second = time.monotonic()
        daemon.process.send_signal(signal.SIGINT)
        assert daemon.wait(10) == 128 + signal.SIGINT
        assert time.monotonic() - second < 5
        long.join(10)
        assert long.error is not None or "[DONE]" not in long.events  # cut off, not finished
    finally:
        stop(daemon)
    assert "second SIGINT: exiting now" in daemon.log.read_text()


# A completion that outlives the engine in tests.support.faulty_serve (it fails at its fourth step).
LONG_COMPLETION = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def start_failing_daemon(tmp_path: Path, qwen3_dir: Path, *flags: str) -> tuple[Daemon, Stream]:
    """The daemon with an engine that fails at its fourth step, and a long completion streaming
    from it (its first event already in)."""
    daemon = start_daemon(
        tmp_path,
        [str(qwen3_dir), "--num-kv-blocks", "64", "--max-model-len", "256", *flags],
        module="tests.support.faulty_serve",
        env={"PAGEDSERVE_TEST_FAULT_AFTER": "3"},
    )
    try:
        stream = Stream(daemon.url, LONG_COMPLETION).start()
        assert stream.first_event.wait(60)
    except BaseException:
        stop(daemon)
        raise
    return daemon, stream


def test_engine_failure_fails_in_flight_and_exits_1(tmp_path: Path, qwen3_dir: Path) -> None:
    daemon, stream = start_failing_daemon(tmp_path, qwen3_dir)
    try:
        plain = httpx.post(daemon.url + "/v1/completions", json=LONG_COMPLETION, timeout=60)
        assert plain.status_code == 500
        assert (
            plain.json()["error"]["type"] == "server_error"
            and "injected fault" in plain.json()["error"]["message"]
        )
        stream.join(30)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        assert (
            set(stream.events[-2]) == {"error"}
            and "injected fault" in stream.events[-2]["error"]["message"]
        )
        assert daemon.wait(30) == 1
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "Traceback" in log and "RuntimeError: injected fault" in log
    assert "stopped (exit status 1)" in log


def test_engine_failure_mid_response_stream_ends_it_failed(tmp_path: Path, qwen3_dir: Path) -> None:
    """A Responses stream cut by an engine failure ends with an `error` event and then
    `response.failed`, numbered in order like every event before them."""
    daemon, stream = start_failing_daemon(tmp_path, qwen3_dir, "--responses-store", "none")
    try:
        request = {"input": "Hi", "max_output_tokens": 200, "stream": True, "store": False}
        events = []
        with httpx.stream(
            "POST", daemon.url + "/v1/responses", json=request, timeout=60
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: ") :]))
        kinds = [event["type"] for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-2:] == ["error", "response.failed"]
        assert "injected fault" in events[-2]["message"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed"
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        kept = [p["text"] for i in failed["output"] if i["type"] == "message" for p in i["content"]]
        assert "".join(kept) == streamed  # the output streamed before the failure
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        stream.join(30)
        assert daemon.wait(30) == 1
    finally:
        stop(daemon)


def test_a_stuck_engine_step_turns_health_503_then_exits_1(tmp_path: Path, qwen3_dir: Path) -> None:
    """A step that never returns (an injected hang): past --engine-step-timeout /health says
    why with a 503, and after --shutdown-timeout more the process exits 1 to be restarted."""
    daemon = start_daemon(
        tmp_path,
        [str(qwen3_dir), "--num-kv-blocks", "64", "--max-model-len", "256"]
        + ["--engine-step-timeout", "2", "--shutdown-timeout", "3"],
        module="tests.support.faulty_serve",
        env={"PAGEDSERVE_TEST_FAULT": "hang"},
    )
    try:
        assert httpx.get(daemon.url + "/health", timeout=10).status_code == 200
        stuck = Stream(daemon.url, LONG_COMPLETION).start()
        started = time.monotonic()
        health = wait_for_status(daemon.url + "/health", 503)
        assert time.monotonic() - started >= 2
        error = health.json()["error"]
        assert error["code"] == "engine_stuck" and "--engine-step-timeout" in error["message"]
        assert daemon.wait(60) == 1
        assert time.monotonic() - started < 2 + 3 + 30  # the limits, then shutting down
        stuck.join(10)
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "the engine step has run for" in log and "1 sequences" in log
    assert "stopped (exit status 1)" in log
