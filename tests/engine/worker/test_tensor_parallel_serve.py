"""`pagedserve serve --tensor-parallel-size 2` as a real process on 127.0.0.1: it serves streaming
and non-streaming requests with one rank's tokens; a worker killed mid-stream fails the stream
with an error event and makes the server exit non-zero within seconds; one killed while the
engine is idle turns /health 503 at once; a SIGTERM leaves no child process and no
shared-memory file behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx

from config import ServerConfig
from engine import LLM, SamplingParams
from tests.support.server_harness import (
    Daemon,
    RunningServer,
    Stream,
    start_daemon,
    start_engine,
    stop,
    wait_for_status,
    wait_until,
)

ARGS = ["--num-kv-blocks", "64", "--max-model-len", "256", "--tensor-parallel-size", "2"]
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_tp_daemon(tmp_path: Path, model_dir: Path) -> tuple[Daemon, int, list[int]]:
    """The daemon, its worker's pid, and all its children (the worker and multiprocessing's
    resource tracker)."""
    daemon = start_daemon(tmp_path, [str(model_dir), *ARGS])
    kids = children(daemon.process.pid)
    [worker] = [pid for pid in kids if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    return daemon, worker, kids


def test_serves_one_ranks_tokens_and_sigterm_leaves_nothing(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    with LLM(str(qwen3_dir), num_kv_blocks=64, max_model_len=256) as llm:
        want = llm.generate(
            [BODY["prompt"]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )[0].outputs[0]
    daemon, _worker, kids = start_tp_daemon(tmp_path, qwen3_dir)
    try:
        plain = httpx.post(daemon.url + "/v1/completions", json=BODY, timeout=60)
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == want.text
        stream = Stream(daemon.url, BODY).start()
        stream.join(60)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        assert "".join(c["text"] for e in stream.events[:-1] for c in e["choices"]) == want.text
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
    finally:
        stop(daemon)
    wait_until(  # the resource tracker leaves once its pipe closes
        lambda: [pid for pid in kids if alive(pid)],
        10,
        until=lambda left: not left,
        interval=0.1,
        what="the daemon's child processes to exit",
    )
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_a_killed_worker_fails_the_stream_and_the_server_exits_non_zero(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    daemon, worker, _ = start_tp_daemon(tmp_path, qwen3_dir)
    try:
        stream = Stream(daemon.url, {**BODY, "max_tokens": 200}).start()  # about 2 s of steps
        assert stream.first_event.wait(60)
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        stream.join(30)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        error = stream.events[-2]
        assert set(error) == {"error"} and error["error"]["type"] == "server_error", json.dumps(
            error
        )
        assert stream.finish_reasons == []
        status = daemon.wait(30)
        assert status not in (0, None) and time.monotonic() - killed < 15
    finally:
        stop(daemon)
    log = daemon.log.read_text()
    assert "tensor-parallel rank 1" in log and "stopped (exit status 1)" in log


def test_a_worker_killed_while_idle_turns_health_503(qwen3_dir: Path) -> None:
    """In-process, so that the server stays up to be asked: the engine thread is idle when the
    worker dies, and still notices at once."""
    import multiprocessing

    engine = start_engine(
        model=str(qwen3_dir), num_kv_blocks=64, max_model_len=256, tensor_parallel_size=2
    )
    running = RunningServer(engine, ServerConfig())
    try:
        assert httpx.post(running.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
        [worker] = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        health = wait_for_status(running.url + "/health", 503, timeout=10)
        assert "tensor-parallel rank 1 exited with status -9" in health.json()["error"]["message"]
        refused = httpx.post(running.url + "/v1/completions", json=BODY, timeout=10)
        assert (
            refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        )
    finally:
        running.stop()
        engine.shutdown()
    assert multiprocessing.active_children() == []
