"""pagedserve behind a real router: SGLang's model gateway (SMG, the `smg` binary from PyPI) in
front of two replicas on the default model, over loopback. The same multi-turn workload (each
turn resends the conversation so far) goes through the router under `round_robin`, then under
`cache_aware`: routing each conversation back to the replica that holds its prefix must show in
the replicas' own prefix-cache counters. Under `least_load`, a replica kept busy gets few of
the new requests. A Responses conversation continued through the router lands on the other
replica and still sees its history, through the Redis store the replicas share. A replica killed
under load: its in-flight streams end visibly, never hang, the router keeps serving from the
other, and the replica restarted on its port rejoins."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.redis_server import running_redis
from tests.support.server_harness import (
    MODEL,
    Daemon,
    Samples,
    free_port,
    scrape,
    start_daemon,
    stop,
    wait_until_answering,
)

MAX_NUM_SEQS = 4
CONVERSATIONS = 3  # odd: round robin over two replicas then alternates each conversation's turns
TURNS = 4
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island"]


@pytest.fixture(scope="module")
def replicas(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    with running_redis(tmp_path_factory.mktemp("redis")) as store:
        try:
            for i in range(2):
                folder = tmp_path_factory.mktemp(f"replica{i}")
                argv = [
                    str(default_model_dir),
                    "--served-model-name", MODEL,
                    "--max-num-seqs", str(MAX_NUM_SEQS),
                    # vLLM's metric names: SMG reads a vLLM-like worker's load from them.
                    "--metrics-names", "vllm",
                    # One response store for all replicas, as behind any load balancer.
                    "--responses-store", store,
                ]  # fmt: skip
                started.append(
                    start_daemon(folder, argv, env={"PAGEDSERVE_CACHE_DIR": str(folder)})
                )
            yield started
        finally:
            for daemon in started:
                stop(daemon)


def value(samples: Samples, name: str, **labels: str) -> float:
    """A replica's series under vLLM's name and labels (--metrics-names vllm)."""
    key = tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))
    return samples.get(("vllm:" + name, key), 0.0)


def router(
    replicas: list[Daemon], policy: str, log: Path, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    # Installed beside this interpreter by the dev extra (PATH may not hold the venv's bin).
    beside = Path(sys.executable).parent / "smg"
    binary = shutil.which("smg") or (str(beside) if beside.exists() else None)
    assert binary is not None, "smg is not installed (the dev extra installs it)"
    port, metrics_port = free_port(), free_port()
    argv = [
        binary, "launch",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", policy,
        "--worker-urls", *(r.url for r in replicas),
        *extra,
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/health", process, log, timeout=60)
    except BaseException:
        process.kill()
        raise
    return process, url


def conversation_system(tag: str, c: int) -> str:
    # A long, distinct opening for each conversation: its prefix spans several KV blocks and is
    # shared with no other conversation.
    words = " ".join(WORDS[(c * 5 + i) % len(WORDS)] for i in range(60))
    return f"Conversation {tag}-{c}. Remember these words: {words}."


def run_workload(url: str, tag: str) -> None:
    histories = [
        [{"role": "system", "content": conversation_system(tag, c)}] for c in range(CONVERSATIONS)
    ]
    with httpx.Client(base_url=url, timeout=120) as client:
        for turn in range(TURNS):
            for history in histories:
                history.append({"role": "user", "content": f"Turn {turn}: name one of the words."})
                response = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": history,
                        "max_tokens": 6,
                        "temperature": 0,
                    },
                )
                assert response.status_code == 200, response.text
                reply = response.json()["choices"][0]["message"]["content"]
                history.append({"role": "assistant", "content": reply})


def hit_rate(replicas: list[Daemon], policy: str, tag: str, tmp_path: Path) -> float:
    before = [scrape(r.url) for r in replicas]
    process, url = router(replicas, policy, tmp_path / f"smg-{policy}.log")
    try:
        run_workload(url, tag)
    finally:
        process.terminate()
        process.wait(10)
    after = [scrape(r.url) for r in replicas]

    def total(name: str) -> float:
        return sum(value(a, name) - value(b, name) for a, b in zip(after, before))

    queries = total("prefix_cache_queries_total")
    assert queries > 0, "no request reached a replica"
    return total("prefix_cache_hits_total") / queries


def test_cache_aware_routing_keeps_conversations_on_their_prefix(
    replicas: list[Daemon], tmp_path: Path
) -> None:
    spread = hit_rate(replicas, "round_robin", "rr", tmp_path)
    kept = hit_rate(replicas, "cache_aware", "ca", tmp_path)
    # Under cache_aware every turn after the first finds the whole previous turn cached; under
    # round robin each turn lands on the replica that saw the turn before last.
    assert kept > spread + 0.15, (kept, spread)


def hog(url: str, stop: threading.Event) -> None:
    """A long generation sent straight to one replica, streamed until `stop` (then the client
    goes away and the replica aborts it)."""
    body = {
        "model": MODEL,
        "prompt": "Count:",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        for _ in response.iter_lines():
            if stop.is_set():
                return


def short_request(url: str, i: int) -> int:
    body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 4, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).status_code


def test_least_load_sends_new_requests_away_from_a_busy_replica(
    replicas: list[Daemon], tmp_path: Path
) -> None:
    busy, _ = replicas
    before = [scrape(r.url) for r in replicas]
    stop_hogs = threading.Event()
    # The busy replica's whole batch taken by long generations that did not come through the
    # router, as many again waiting behind them: a request routed to it waits too.
    hogs = [
        threading.Thread(target=hog, args=(busy.url, stop_hogs)) for _ in range(2 * MAX_NUM_SEQS)
    ]
    for thread in hogs:
        thread.start()
    # least_load weighs each worker by the load it last polled from its /metrics: poll often.
    process, url = router(
        replicas,
        "least_load",
        tmp_path / "smg-least_load.log",
        ("--load-monitor-interval", "1"),
    )
    try:
        deadline = time.monotonic() + 60
        while value(scrape(busy.url), "num_requests_waiting") < MAX_NUM_SEQS:
            assert time.monotonic() < deadline, "the busy replica never filled its queue"
            time.sleep(0.2)
        time.sleep(2)  # a poll or two of the router sees it
        # One at a time: the router counts its own dispatches since the last poll as load, so
        # a burst of concurrent requests would make the idle replica look busy too.
        n = 8
        with ThreadPoolExecutor(1) as pool:
            futures = [pool.submit(short_request, url, i) for i in range(n)]
            # Wait while requests still complete; the ones stuck behind the hogs finish once
            # the hogs are stopped.
            done, last_progress = 0, time.monotonic()
            while done < n and time.monotonic() - last_progress < 8:
                time.sleep(0.5)
                now_done = sum(f.done() for f in futures)
                if now_done > done:
                    done, last_progress = now_done, time.monotonic()
            stop_hogs.set()
            assert [f.result() for f in futures] == [200] * n
    finally:
        stop_hogs.set()
        for thread in hogs:
            thread.join(30)
        process.terminate()
        process.wait(10)
    after = [scrape(r.url) for r in replicas]
    served = [
        value(a, "request_success_total", finished_reason="length")
        - value(b, "request_success_total", finished_reason="length")
        for a, b in zip(after, before)
    ]
    assert sum(served) == n
    # Round robin would give each replica half; least load sends them to the idle one.
    assert served[1] >= n - 1, served


def respond(url: str, text: str, previous: str | None = None) -> dict:
    body = {"model": MODEL, "input": text, "max_output_tokens": 8, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    response = httpx.post(url + "/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def test_a_responses_conversation_continues_on_the_other_replica(
    replicas: list[Daemon], tmp_path: Path
) -> None:
    before = [scrape(r.url) for r in replicas]
    process, url = router(replicas, "round_robin", tmp_path / "smg-responses.log")
    try:
        first = respond(url, "Name a colour.")
        second = respond(url, "And another one.", previous=first["id"])
    finally:
        process.terminate()
        process.wait(10)
    after = [scrape(r.url) for r in replicas]
    served = [
        value(a, "request_success_total", finished_reason="length")
        + value(a, "request_success_total", finished_reason="stop")
        - value(b, "request_success_total", finished_reason="length")
        - value(b, "request_success_total", finished_reason="stop")
        for a, b in zip(after, before)
    ]
    assert served == [1, 1], served  # round robin: each turn on its own replica
    assert second["previous_response_id"] == first["id"]
    # The continuation saw the first turn: it equals the same continuation sent straight to
    # each replica (greedy), and differs from the question asked with no history.
    for replica in replicas:
        alone = respond(replica.url, "And another one.", previous=first["id"])
        assert text(alone) == text(second)
        assert alone["usage"]["input_tokens"] == second["usage"]["input_tokens"]
    fresh = respond(replicas[0].url, "And another one.")
    assert fresh["usage"]["input_tokens"] < second["usage"]["input_tokens"]


def stream(url: str, i: int) -> str:
    """A streamed completion through the router: 'done' when it reached its length and
    [DONE], 'broken' when it ended early (the connection dropped, an error event came, or the
    stream closed without a finish reason), 'error' on an error status."""
    body = {
        "model": MODEL,
        "prompt": f"Story {i}:",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url + "/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                return "error"
            data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError:
        return "broken"
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    finished = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    if (
        data
        and data[-1] == "[DONE]"
        and "length" in finished
        and not any("error" in c for c in chunks)
    ):
        return "done"
    return "broken"


def restart(daemon: Daemon) -> Daemon:
    """The same command line again, on the same port (the router knows the replica by URL)."""
    folder = daemon.log.parent
    process = subprocess.Popen(
        daemon.process.args,
        stdout=(folder / "serve-restarted.log").open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(folder)},
    )
    again = Daemon(process, daemon.url, folder / "serve-restarted.log")
    try:
        wait_until_answering(again.url + "/health", process, again.log, timeout=180)
    except BaseException:
        process.kill()
        raise
    return again


def test_a_killed_replica_fails_its_streams_visibly_and_rejoins_after_restart(
    replicas: list[Daemon], tmp_path: Path
) -> None:
    victim, survivor = replicas
    # Short health checks, so that the router notices the death and the return within seconds.
    process, url = router(
        replicas,
        "round_robin",
        tmp_path / "smg-failure.log",
        (
            "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
            "--health-success-threshold", "1",
        ),
    )  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream, url, i) for i in range(2)]  # one on each replica
            deadline = time.monotonic() + 60
            while value(scrape(victim.url), "num_requests_running") < 1:
                assert time.monotonic() < deadline, "the streams never reached the victim"
                time.sleep(0.1)
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(10)
            # Every stream ends by itself (never a hang): the one on the dead replica broken
            # (SMG closes it with [DONE] but no finish reason), the other complete.
            outcomes = sorted(f.result(timeout=300) for f in streams)
        assert outcomes == ["broken", "done"], outcomes

        # The router keeps serving, from the survivor.
        before = scrape(survivor.url)
        for i in range(4):
            assert short_request(url, i) == 200
        served = value(scrape(survivor.url), "request_success_total", finished_reason="length")
        assert served - value(before, "request_success_total", finished_reason="length") == 4

        # Restarted on its port, the replica gets requests again.
        replicas[0] = victim = restart(victim)  # the fixture stops this process at the end
        deadline = time.monotonic() + 60
        while value(scrape(victim.url), "request_success_total", finished_reason="length") == 0:
            assert time.monotonic() < deadline, "the restarted replica never got a request"
            assert short_request(url, 99) == 200
            time.sleep(0.5)
    finally:
        process.terminate()
        process.wait(10)
