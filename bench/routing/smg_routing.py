"""Prefix-aware routing through SGLang's model gateway (SMG): the same multi-turn chat workload
through `smg launch --policy cache_aware` and `--policy round_robin`, in front of the same
pagedserve replicas, side by side.

    python bench/routing/smg_routing.py [--replicas 2] [--conversations 8] [--turns 6] [--rounds 2]

The replicas run the default model (`--metrics-names vllm`, which SMG reads load from; each its
own process and cache directory) and stay up for the whole run; only the router is started
again for each policy. Each conversation is a client of its own, all running at once: a long
system prompt of its own, then turns that resend the whole conversation so far (as chat
clients do), streamed, greedy, `--max-tokens` each. Every round runs both policies, in
alternating order, each on conversations no replica has seen (a fresh tag in every system
prompt), so neither inherits the other's cache.

Per policy it reports the prefix-cache hit rate (the replicas' own
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, summed over the
replicas), the mean and median time to first token seen by the clients, and the wall time of
the workload. The `smg` binary comes from the dev extra (`pip install smg`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))  # soak's server helpers

from soak import MODEL, start_server

WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island"]


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def start_router(urls: list[str], policy: str, port: int, log: Path) -> subprocess.Popen:
    beside = Path(sys.executable).parent / "smg"
    binary = shutil.which("smg") or str(beside)
    argv = [
        binary, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1),
        "--policy", policy, "--worker-urls", *urls,
    ]  # fmt: skip
    router = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    router.kill()
    raise SystemExit(f"smg did not answer /health; see {log}")


async def turn_ttft(
    client: httpx.AsyncClient, messages: list[dict], max_tokens: int
) -> tuple[float, str]:
    """Streams one turn: seconds to the first content token, and the whole reply."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    reply = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"turn failed: {response.status_code} {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("delta", {}).get("content")
            if piece:
                first = time.perf_counter() - start if first is None else first
                reply.append(piece)
    return (first if first is not None else time.perf_counter() - start), "".join(reply)


async def conversation(url: str, tag: str, c: int, turns: int, max_tokens: int) -> list[float]:
    words = " ".join(WORDS[(c * 5 + i) % len(WORDS)] for i in range(80))
    system = f"Conversation {tag}-{c}. Remember these words: {words}."
    messages: list[dict] = [{"role": "system", "content": system}]
    ttfts = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for t in range(turns):
            messages.append({"role": "user", "content": f"Turn {t}: name one of the words."})
            ttft, reply = await turn_ttft(client, messages, max_tokens)
            ttfts.append(ttft)
            messages.append({"role": "assistant", "content": reply})
    return ttfts


def run_policy(
    replicas: list[str], policy: str, tag: str, args: argparse.Namespace, folder: Path
) -> dict:
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    before = [[counter(r, n) for n in names] for r in replicas]
    router = start_router(replicas, policy, args.router_port, folder / f"smg-{tag}.log")
    try:
        url = f"http://127.0.0.1:{args.router_port}"
        start = time.perf_counter()

        async def workload() -> list[list[float]]:
            return await asyncio.gather(
                *(
                    conversation(url, tag, c, args.turns, args.max_tokens)
                    for c in range(args.conversations)
                )
            )

        ttfts = [t for conv in asyncio.run(workload()) for t in conv]
        wall = time.perf_counter() - start
    finally:
        router.terminate()
        router.wait(10)
    after = [[counter(r, n) for n in names] for r in replicas]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "policy": policy,
        "hit_rate": hits / queries,
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_median_ms": 1000 * statistics.median(ttfts),
        "wall_s": wall,
        "requests": len(ttfts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18100, help="first replica's port")
    parser.add_argument("--router-port", type=int, default=18200)
    parser.add_argument("--out", type=Path, default=Path("bench/out/smg_routing.json"))
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="smg-routing-"))
    servers = []
    try:
        for i in range(args.replicas):
            cache = folder / f"replica{i}"
            cache.mkdir()
            flags = ["--metrics-names", "vllm", "--max-num-seqs", str(args.max_num_seqs)]
            servers.append(start_server(args.port + i, str(cache), flags))
        urls = [url for _, url in servers]
        results = []
        for r in range(args.rounds):
            order = ("round_robin", "cache_aware") if r % 2 == 0 else ("cache_aware", "round_robin")
            for policy in order:
                result = run_policy(urls, policy, f"{policy}-{r}", args, folder)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        for server, _ in servers:
            server.terminate()
            server.wait(30)
    print(f"{'policy':<12} {'hit rate':>9} {'TTFT mean':>10} {'TTFT p50':>9} {'wall':>7}")
    for policy in ("cache_aware", "round_robin"):
        mine = [r for r in results if r["policy"] == policy]
        print(
            f"{policy:<12} {statistics.fmean(r['hit_rate'] for r in mine):>9.3f}"
            f" {statistics.fmean(r['ttft_mean_ms'] for r in mine):>8.0f}ms"
            f" {statistics.fmean(r['ttft_median_ms'] for r in mine):>7.0f}ms"
            f" {statistics.fmean(r['wall_s'] for r in mine):>6.1f}s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
