"""Soak: a long mixed workload against a `pagedserve serve` it starts, watching for leaks.

    python bench/serving/soak.py [--requests 50000] [--concurrency 16] [--out bench/out/soak.json]

The server runs the default model (its own process, a cache directory of its own). The client
sends, in a seeded random mix: plain completions, streamed chat, structured outputs
(json_schema), forced tool calls, and Responses (stored); 5% of the streamed requests are
cancelled after their first chunk. Every `--sample-every` requests it reads the server's RSS
(/proc) and its gauges (/metrics). At the end it waits for the engine to drain and reads them
once more.

It reports: requests by kind and outcome (every answer must be 200, a cancelled stream counts
as cancelled), requests per second, the RSS series and, over its last 60%, the spread (max -
min) and the least-squares slope in MB per 10,000 requests: flat means the slope is near 0 and
the spread small against the whole; and the gauges once idle (running, waiting, KV usage 0).
Writes `--out` (JSON) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
KINDS = ("plain", "stream", "structured", "tool", "responses")
WEIGHTS = (0.3, 0.3, 0.15, 0.15, 0.1)
CANCEL_SHARE = 0.05  # of the streamed requests
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "people": {"type": "integer"}},
    "required": ["name", "people"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
        },
    },
}
TOPICS = ["cats", "rain", "Paris", "the sea", "bread", "trains", "music", "snow", "tea", "maps"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def gauges(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("pagedserve:")
            if name in GAUGES:
                found[name] = sample.value
    return found


def request_for(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    topic = rng.choice(TOPICS)
    chat = [{"role": "user", "content": f"Say something about {topic}."}]
    if kind == "plain":
        return "/v1/completions", {"prompt": f"A note about {topic}:", "max_tokens": 6}
    if kind == "stream":
        return "/v1/chat/completions", {"messages": chat, "max_tokens": 8, "stream": True}
    if kind == "structured":
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
        ask = [{"role": "user", "content": f"A city known for {topic}, as JSON."}]
        return "/v1/chat/completions", {
            "messages": ask,
            "max_tokens": 24,
            "temperature": 0,
            "response_format": fmt,
        }
    if kind == "tool":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Weather where {topic} are?"}],
            "max_tokens": 24,
            "temperature": 0,
            "tools": [WEATHER],
            "tool_choice": "required",
        }
    return "/v1/responses", {"input": f"One line on {topic}.", "max_output_tokens": 6}


async def one(
    client: httpx.AsyncClient, kind: str, rng: random.Random, outcomes: Counter[str]
) -> None:
    path, body = request_for(kind, rng)
    body["model"] = MODEL
    cancel = body.get("stream") and rng.random() < CANCEL_SHARE
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    outcomes[f"{kind}:{response.status_code}"] += 1
                    return
                async for _ in response.aiter_lines():
                    if cancel:
                        outcomes[f"{kind}:cancelled"] += 1
                        return  # leaving the block closes the connection mid-stream
            outcomes[f"{kind}:200"] += 1
        else:
            response = await client.post(path, json=body)
            outcomes[f"{kind}:{response.status_code}"] += 1
    except httpx.HTTPError as exc:
        outcomes[f"{kind}:{type(exc).__name__}"] += 1


def slope_and_spread(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope (MB per 10,000 requests) and max - min of RSS over `points`."""
    n = len(points)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return slope * 10_000, max(ys) - min(ys)


async def drive(args: argparse.Namespace, base_url: str, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kinds = rng.choices(KINDS, WEIGHTS, k=args.requests)
    outcomes: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    done = 0
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    started = time.monotonic()
    with httpx.Client(base_url=base_url) as plain:
        samples.append({"requests": 0, "rss_mb": rss_mb(pid), **gauges(plain)})
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

            async def worker(seed: int) -> None:
                nonlocal done
                own = random.Random(seed)
                while not queue.empty():
                    kind = queue.get_nowait()
                    await one(client, kind, own, outcomes)
                    done += 1
                    if done % args.sample_every == 0:
                        samples.append(
                            {
                                "requests": done,
                                "seconds": time.monotonic() - started,
                                "rss_mb": rss_mb(pid),
                                **gauges(plain),
                            }
                        )
                        print(f"{done} requests, RSS {samples[-1]['rss_mb']:.0f} MB", flush=True)

            await asyncio.gather(*(worker(args.seed * 1000 + i) for i in range(args.concurrency)))
        seconds = time.monotonic() - started
        idle: dict[str, float] = {}
        for _ in range(100):  # the engine drains what the cancelled streams left
            idle = gauges(plain)
            if idle.get("num_requests_running") == 0 and idle.get("num_requests_waiting") == 0:
                break
            time.sleep(0.1)
        final_rss = rss_mb(pid)
    tail = [(s["requests"], s["rss_mb"]) for s in samples if s["requests"] >= 0.4 * args.requests]
    slope, spread = slope_and_spread(tail) if len(tail) >= 2 else (float("nan"), float("nan"))
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "seconds": seconds,
        "requests_per_s": args.requests / seconds,
        "outcomes": dict(sorted(outcomes.items())),
        "rss_first_mb": samples[0]["rss_mb"],
        "rss_final_mb": final_rss,
        "rss_last60_slope_mb_per_10k": slope,
        "rss_last60_spread_mb": spread,
        "idle_gauges": idle,
        "samples": samples,
    }


def start_server(port: int, cache: str, extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """`pagedserve serve` on the default model at 127.0.0.1:`port` (with the flags `extra`),
    with `cache` as its cache directory, once /health answers 200 (or after 300 s); the process
    and its base URL."""
    # The converted default model is reused from the usual cache, not rebuilt in `cache`.
    default = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache/pagedserve"))
    model = default / MODEL
    argv = [sys.executable, "-m", "server.cli", "serve", *([str(model)] if model.exists() else [])]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL, *extra]
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": cache}
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return server, base_url


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--port", type=int, default=8317)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/out/soak.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as cache:
        server, base_url = start_server(args.port, cache)
        try:
            report = asyncio.run(drive(args, base_url, server.pid))
        finally:
            server.send_signal(signal.SIGTERM)
            report_exit = server.wait(60)
    report["exit_status"] = report_exit
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
