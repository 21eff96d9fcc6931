"""Streaming clients and a /health probe for load tests, each runnable in a process of its own.

A server under test often runs in the test's process (so that a test can read the engine's
state). Five hundred client coroutines parsing SSE in that process would hold the same GIL as
the server's event loop, and /health would wait on the test's clients rather than on the
server: in production neither the clients nor the kubelet share the server's interpreter. So
`run_storm` and `HealthProbe` start `python -m tests.support.http_load storm|probe URL`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StreamResult:
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # one entry per token, as chunks carried them
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False


async def stream_completion(client: httpx.AsyncClient, body: dict) -> StreamResult:
    result = StreamResult()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                result.done = True
                continue
            assert not result.done, "an event after [DONE]"
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                result.text += choice["text"]
                result.tokens += choice["logprobs"]["tokens"]
                if choice["finish_reason"] is not None:
                    result.finish_reasons.append(choice["finish_reason"])
    return result


async def stream_all(url: str, bodies: list[dict]) -> list[StreamResult]:
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(stream_completion(client, b) for b in bodies))


def _command(mode: str, url: str) -> list[str]:
    return [sys.executable, "-m", "tests.support.http_load", mode, url]


def run_storm(url: str, bodies: list[dict], timeout: float = 600) -> list[StreamResult]:
    """Every body streamed at once from another process; each stream's result, in order."""
    done = subprocess.run(
        _command("storm", url),
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [StreamResult(**r) for r in json.loads(done.stdout)]


class HealthProbe:
    """Polls /health every `period` seconds from another process, as a kubelet would, until the
    block ends; then holds each poll's latency and status."""

    def __init__(self, url: str, period: float = 0.2) -> None:
        self.url = url
        self.period = period
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> HealthProbe:
        self._process = subprocess.Popen(
            [*_command("probe", self.url), str(self.period)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        return self

    def __exit__(self, *_: object) -> None:
        assert self._process is not None
        out, _err = self._process.communicate("", timeout=30)  # closing stdin stops it
        polls = json.loads(out)
        self.latencies = [latency for latency, _ in polls]
        self.statuses = [status for _, status in polls]


def _probe(url: str, period: float) -> list[tuple[float, int]]:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    polls = []
    with httpx.Client(timeout=10) as client:
        while not stop.wait(period):
            start = time.monotonic()
            status = client.get(url + "/health").status_code
            polls.append((time.monotonic() - start, status))
    return polls


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "storm":
        results = asyncio.run(stream_all(url, json.loads(sys.stdin.read())))
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(json.dumps(_probe(url, float(sys.argv[3]))))
