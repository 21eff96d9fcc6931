"""Does the HTTP frontend keep up with an engine at GPU rates? The stand-in engine
(standin_engine.py: real bridge, real outputs and detokenizer, a decode step every --step-ms)
is served by the real app over 127.0.0.1 and loaded with streamed requests at each concurrency,
on /v1/completions and /v1/chat/completions. Per row: the server's aggregate output tok/s as the
client received them, the stand-in's offered tok/s (the same requests stepped with nobody
reading: the offline engine), their ratio, the gaps between a stream's events (p50 / p99 ITL),
tokens per event (above 1: outputs were coalesced), and the CPU seconds the server process and
the client spent per 1,000 tokens.

Several checkouts side by side in one run, alternated (`--root NAME=PATH`, e.g. the parent
commit in a `git worktree`), since a shared machine's speed drifts from minute to minute:

    python bench/serving/frontend_throughput.py --streams 64 256 --max-tokens 128 \\
        --root before=/tmp/pagedserve-before --root after=.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sse_stream import SSEClient
from standin_engine import offline_rate

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Row:
    root: str
    route: str
    streams: int
    tokens: int = 0
    engine_tokens: int = 0  # what the stand-in emitted meanwhile
    engine_seconds: float = 0.0  # from the start to its last token
    events: int = 0
    seconds: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    errors: int = 0
    gaps: list[float] = field(default_factory=list)

    def summary(self, offered: float) -> dict[str, float | str | int]:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        gaps = sorted(self.gaps) or [0.0]
        return {
            "root": self.root,
            "route": self.route,
            "streams": self.streams,
            "server_tok_s": round(rate),
            "offered_tok_s": round(offered),
            # The stand-in's own rate while serving: below offered, the engine thread itself
            # was held back (the GIL, the CPU); near it, the loss is the frontend's backlog.
            "engine_tok_s": round(self.engine_tokens / max(self.engine_seconds, 1e-9)),
            "ratio": round(rate / offered, 3),
            "itl_p50_ms": round(1000 * statistics.median(gaps), 2),
            "itl_p99_ms": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
            "tokens_per_event": round(self.tokens / max(self.events, 1), 2),
            "server_cpu_s_per_1k_tok": round(1000 * self.server_cpu / max(self.tokens, 1), 4),
            "client_cpu_s_per_1k_tok": round(1000 * self.client_cpu / max(self.tokens, 1), 4),
            "errors": self.errors,
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """The stand-in served from one checkout, in a process of its own."""

    def __init__(self, name: str, root: Path, step_ms: float, extra: list[str]) -> None:
        self.name, self.port = name, _free_port()
        env = dict(os.environ, PYTHONPATH=str(root))
        # A checkout from before bench/ was split by subject keeps the stand-in at the top.
        standin = root / "bench" / "serving" / "standin_engine.py"
        if not standin.exists():
            standin = root / "bench" / "standin_engine.py"
        command = [sys.executable, str(standin)]
        command += ["--port", str(self.port), "--step-ms", str(step_ms), *extra]
        self.process = subprocess.Popen(command, cwd=root, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {name} server did not start") from None
                time.sleep(0.5)

    def tokens_emitted(self) -> tuple[int, float]:
        """The stand-in's tokens so far, and when (time.time()) it emitted the last."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/standin/tokens") as answer:
            got = json.load(answer)
        return int(got["tokens"]), float(got["last"])

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def _body(route: str, i: int, max_tokens: int, n: int) -> bytes:
    words = f"Request {i}: tell me about the river"
    body: dict[str, object] = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    return json.dumps(body).encode()


async def _load(
    server: Server, route: str, streams: int, rounds: int, max_tokens: int, n: int = 1
) -> Row:
    row = Row(server.name, route, streams)
    client = SSEClient(f"http://127.0.0.1:{server.port}{ROUTES[route]}")

    async def one_stream(i: int) -> None:
        for r in range(rounds):
            times: list[float] = []

            def on_data(payload: bytes, times: list[float] = times) -> None:
                if b'"usage":{' in payload:
                    row.tokens += json.loads(payload)["usage"]["completion_tokens"]
                elif payload != b"[DONE]":
                    times.append(time.perf_counter())

            end = await client.post(_body(route, i * rounds + r, max_tokens, n), on_data)
            if end.status != 200 or not end.done:
                row.errors += 1
            # Chat's first event is the role, sent before any token: its gap is not a token's.
            events = times[1:] if route == "chat" else times
            row.events += len(events)
            row.gaps.extend(b - a for a, b in itertools.pairwise(events))

    cpu_before, client_before = _cpu_seconds(server.process.pid), time.process_time()
    emitted, _ = server.tokens_emitted()
    started, started_wall = time.perf_counter(), time.time()
    await asyncio.gather(*(one_stream(i) for i in range(streams)))
    row.seconds = time.perf_counter() - started
    total, last = server.tokens_emitted()
    row.engine_tokens, row.engine_seconds = total - emitted, last - started_wall
    row.server_cpu = _cpu_seconds(server.process.pid) - cpu_before
    row.client_cpu = time.process_time() - client_before
    client.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        action="append",
        default=[],
        help="NAME=PATH [ARGS]: a checkout, its server's args",
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n", type=int, default=1, help="samples per request (n)")
    parser.add_argument("--rounds", type=int, default=2, help="requests each stream sends in turn")
    parser.add_argument("--repeats", type=int, default=1, help="times each row runs (alternated)")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--server-arg", action="append", default=[], help="passed to the servers")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    # NAME=PATH, then arguments for that server alone: --root "plain=. --no-coalesce".
    roots = [r.split("=", 1) for r in args.root] or [["this", "."]]
    offered = {
        n: offline_rate(args.step_ms / 1000, n * args.n, args.max_tokens)
        for n in sorted(set(args.streams))
    }
    servers = []
    for name, value in roots:
        path, *own = value.split()
        servers.append(Server(name, Path(path).resolve(), args.step_ms, args.server_arg + own))
    rows = []
    try:
        for _ in range(args.repeats):
            for route in args.routes:
                for n in args.streams:
                    for server in servers:
                        asyncio.run(_load(server, route, 4, 1, 8))  # warm the route up
                        row = _load(server, route, n, args.rounds, args.max_tokens, args.n)
                        summary = asyncio.run(row).summary(offered[n])
                        print(json.dumps(summary), flush=True)
                        rows.append(summary)
    finally:
        for server in servers:
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
