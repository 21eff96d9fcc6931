"""pagedserve behind a real router: SGLang's model gateway (SMG, the `smg` binary from PyPI) in
front of two replicas on the default model, over loopback. The same multi-turn workload (each
turn resends the conversation so far) goes through the router under `round_robin`, then under
`cache_aware`: routing each conversation back to the replica that holds its prefix must show in
the replicas' own prefix-cache counters."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_harness import (
    MODEL,
    Daemon,
    free_port,
    scrape,
    start_daemon,
    stop,
    value,
    wait_until_answering,
)

CONVERSATIONS = 3  # odd: round robin over two replicas then alternates each conversation's turns
TURNS = 4
WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island"]


@pytest.fixture(scope="module")
def replicas(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    try:
        for i in range(2):
            folder = tmp_path_factory.mktemp(f"replica{i}")
            started.append(
                start_daemon(
                    folder,
                    [str(default_model_dir), "--served-model-name", MODEL, "--max-num-seqs", "4"],
                    env={"PAGEDSERVE_CACHE_DIR": str(folder)},
                )
            )
        yield started
    finally:
        for daemon in started:
            stop(daemon)


def router(replicas: list[Daemon], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
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
