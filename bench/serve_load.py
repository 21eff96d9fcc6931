"""Serving load: streamed `POST /v1/completions` against any OpenAI-compatible server.

Every request sends a prompt of random token ids (seeded, so two servers get the same prompts),
asks for exactly `output_len` tokens (`ignore_eos`, greedy) and is streamed, so that the time to
the first token and the gaps between tokens can be measured on the client side:

- TTFT: request sent -> first chunk with non-empty text
- ITL:  gaps between successive chunks with non-empty text (all requests pooled)
- TPOT: (e2e - TTFT) / (output tokens - 1), one value per request
- e2e:  request sent -> `data: [DONE]`

Arrivals are either a closed loop of `--concurrency` requests in flight, or Poisson at
`--request-rate` requests/s (`inf`: all at once), optionally capped by `--concurrency`. The
requests go over keep-alive connections through `sse_stream.SSEClient`, which spends about half
the CPU per token that httpx did: CPU a client on the server's machine takes from the server.

    python bench/serve_load.py [--base-url http://127.0.0.1:8000] [--num-requests 64]
        [--concurrency 16 | --request-rate 4] [--input-len 128] [--output-len 64] [--out r.json]

As a library: `await run_load(base_url=..., num_requests=..., ...)` returns the same dict that
`--out` writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from sse_stream import SSEClient

LOW_TOKEN_ID = 1000  # below this, vocabularies keep special and control tokens


@dataclass
class WorkItem:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    index: int
    input_len: int
    requested_output_len: int
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int | str = 0,
) -> list[WorkItem]:
    """Prompts of random token ids and their output lengths, the same for the same arguments.

    With `range_ratio` r, each length is drawn uniformly from [len * (1 - r), len * (1 + r)].
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= LOW_TOKEN_ID + 1:
        raise ValueError(f"vocab_size must be above {LOW_TOKEN_ID + 1}, got {vocab_size}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        low, high = int(center * (1 - range_ratio)), math.ceil(center * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    items = []
    for _ in range(num_requests):
        n_in, n_out = length(input_len), length(output_len)
        items.append(
            WorkItem([rng.randint(LOW_TOKEN_ID, vocab_size - 1) for _ in range(n_in)], n_out)
        )
    return items


def warmup_workload(count: int, input_len: int, vocab_size: int, seed: int) -> list[WorkItem]:
    """Short requests with prompts of their own: reusing a measured prompt would let a server's
    prefix cache skip that request's prefill in the measured run."""
    return make_workload(count, input_len, 4, 0.0, vocab_size, f"warmup-{seed}")


def arrival_delays(count: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request (Poisson process); all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    # Its own generator: changing the rate must not change the prompts.
    rng = random.Random(seed + 1_000_003)
    return [rng.expovariate(request_rate) for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 in milliseconds."""
    if not values:
        return {
            "mean_ms": float("nan"),
            "p50_ms": float("nan"),
            "p90_ms": float("nan"),
            "p99_ms": float("nan"),
        }
    ms = [v * 1000.0 for v in values]
    return {
        "mean_ms": sum(ms) / len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
    }


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


async def send_one(
    client: SSEClient, model: str, index: int, item: WorkItem, request_timeout: float
) -> RequestResult:
    result = RequestResult(
        index=index, input_len=len(item.prompt_ids), requested_output_len=item.output_len
    )
    body = {
        "model": model,
        "prompt": item.prompt_ids,
        "max_tokens": item.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        # One deadline for the whole request, not for each read.
        # (wait_for rather than asyncio.timeout: the project still supports Python 3.10.)
        await asyncio.wait_for(
            _stream(client, json.dumps(body).encode(), result, start), request_timeout
        )
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timed out after {request_timeout:g} s"
    except (OSError, ValueError) as exc:  # unreachable, dropped, malformed (JSON included)
        result.ok, result.error = False, f"{type(exc).__name__}: {exc}"
    return result


async def _stream(client: SSEClient, body: bytes, result: RequestResult, start: float) -> None:
    """Read one SSE stream into `result`; `ok` is set only when it ended with `data: [DONE]`."""
    chunks = 0
    usage_tokens: int | None = None
    last = start

    def on_data(payload: bytes) -> None:
        nonlocal chunks, usage_tokens, last
        if payload == b"[DONE]":
            result.e2e = time.perf_counter() - start
            return
        event = json.loads(payload)
        if "error" in event:
            result.error = result.error or f"stream error: {json.dumps(event['error'])[:300]}"
            return
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            if not choice.get("text"):
                continue  # role-only, held-back or final chunks carry no text
            now = time.perf_counter()
            if result.ttft is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            chunks += 1

    end = await client.post(body, on_data)
    if end.status != 200:
        result.error = f"HTTP {end.status}: {end.body.decode(errors='replace')[:300]}"
        return
    if result.error:
        return
    if not end.done:
        result.error = "stream ended without data: [DONE]"
        return
    # A chunk can hold several tokens (or a token can decode to no text): trust usage first.
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no text was streamed"


async def run_load(
    base_url: str = "http://127.0.0.1:8000",
    model: str | None = None,
    num_requests: int = 64,
    concurrency: int | None = None,
    request_rate: float = math.inf,
    input_len: int = 128,
    output_len: int = 64,
    range_ratio: float = 0.0,
    vocab_size: int = 49152,
    seed: int = 0,
    timeout: float = 600.0,
    request_timeout: float | None = None,
    warmup: int = 1,
    keep_requests: bool = True,
) -> dict:
    """Run the workload once against `base_url` and return the metrics (see the module doc)."""
    base_url = base_url.rstrip("/")
    request_timeout = min(request_timeout or timeout, timeout)
    workload = make_workload(num_requests, input_len, output_len, range_ratio, vocab_size, seed)
    delays = arrival_delays(num_requests, request_rate, seed)
    in_flight = concurrency or num_requests
    if model is None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=10.0)) as http:
            model = await first_model_id(http, base_url)
    client = SSEClient(f"{base_url}/v1/completions")
    try:
        # Warm-up requests are not measured: first-call allocation and kernel selection are not load.
        for probe in warmup_workload(warmup, input_len, vocab_size, seed):
            await send_one(client, model, -1, probe, request_timeout)

        gate = asyncio.Semaphore(in_flight)

        async def gated(index: int, item: WorkItem) -> RequestResult:
            async with gate:
                return await send_one(client, model, index, item, request_timeout)

        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        deadline = start + timeout

        async def dispatch() -> None:
            for index, (item, delay) in enumerate(zip(workload, delays)):
                if delay:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(gated(index, item)))

        async def dispatch_and_wait() -> None:
            await dispatch()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            await asyncio.wait_for(dispatch_and_wait(), timeout)
        except asyncio.TimeoutError:
            pass  # everything unfinished is counted as failed below
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        duration = min(time.perf_counter(), deadline) - start
    finally:
        client.close()

    results: list[RequestResult] = []
    for index, item in enumerate(workload):
        task = tasks[index] if index < len(tasks) else None
        if task is not None and not task.cancelled() and task.exception() is None:
            results.append(task.result())
            continue
        if task is None or task.cancelled():
            error = f"unfinished at the {timeout:g} s bound"
        else:
            error = f"{type(task.exception()).__name__}: {task.exception()}"
        results.append(RequestResult(index, len(item.prompt_ids), item.output_len, error=error))
    return build_report(
        results,
        duration,
        {
            "base_url": base_url,
            "model": model,
            "num_requests": num_requests,
            "concurrency": concurrency,
            "request_rate": request_rate,
            "input_len": input_len,
            "output_len": output_len,
            "range_ratio": range_ratio,
            "vocab_size": vocab_size,
            "seed": seed,
            "timeout": timeout,
            "request_timeout": request_timeout,
            "warmup": warmup,
        },
        keep_requests,
    )


def build_report(
    results: list[RequestResult], duration: float, config: dict, keep_requests: bool
) -> dict:
    good = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in good)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    report = {
        "config": config,
        "duration_s": duration,
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": errors,
        # Tokens a server returned beyond or short of max_tokens with ignore_eos: a correctness flag.
        "length_mismatches": sum(1 for r in good if r.output_tokens != r.requested_output_len),
        "input_tokens": sum(r.input_len for r in good),
        "output_tokens": output_tokens,
        "request_throughput": len(good) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "ttft": summarize([r.ttft for r in good if r.ttft is not None]),
        "itl": summarize([gap for r in good for gap in r.itl]),
        "tpot": summarize([t for r in good if (t := r.tpot) is not None]),
        "e2e": summarize([r.e2e for r in good if r.e2e is not None]),
    }
    if keep_requests:
        report["requests"] = [
            {k: v for k, v in asdict(r).items() if k != "itl"} | {"tpot": r.tpot} for r in results
        ]
    return report


def format_report(report: dict, title: str = "") -> str:
    c = report["config"]
    mode = f"concurrency {c['concurrency']}" if c["concurrency"] else "unbounded concurrency"
    if not math.isinf(c["request_rate"]):
        mode += f", Poisson {c['request_rate']:g} req/s"
    lines = [
        (
            f"== {title or c['base_url']} | {c['model']} | {report['completed']}/{c['num_requests']} ok | {mode} "
            f"| in {c['input_len']} out {c['output_len']} (range {c['range_ratio']:g})"
        ),
        (
            f"duration {report['duration_s']:.2f} s | {report['request_throughput']:.2f} req/s "
            f"| {report['output_throughput']:.1f} output tok/s | failed {report['failed']} "
            f"| length mismatches {report['length_mismatches']}"
        ),
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = report[name]
        lines.append(
            f"{name.upper():<12}{s['mean_ms']:>10.1f}{s['p50_ms']:>10.1f}{s['p90_ms']:>10.1f}{s['p99_ms']:>10.1f}"
        )
    for error, count in report["errors"].items():
        lines.append(f"  {count} x {error}")
    return "\n".join(lines)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags, shared with the scripts that reuse this workload."""
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--output-len", type=int, default=64, help="output tokens per request (max_tokens)"
    )
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- r)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=49152,
        help=f"prompt ids are drawn from [{LOW_TOKEN_ID}, this)",
    )
    parser.add_argument("--seed", type=int, default=0)


def add_load_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", type=int, default=None, help="most requests in flight (closed loop)"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: all at once)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="bound on the whole run, seconds"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="bound on one request (default: --timeout)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured short requests sent first"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the first of GET /v1/models)"
    )
    add_workload_args(parser)
    add_load_args(parser)
    parser.add_argument(
        "--out", default=None, help="write the full report (with per-request rows) as JSON"
    )
    args = parser.parse_args()

    report = asyncio.run(
        run_load(
            base_url=args.base_url,
            model=args.model,
            num_requests=args.num_requests,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            vocab_size=args.vocab_size,
            seed=args.seed,
            timeout=args.timeout,
            request_timeout=args.request_timeout,
            warmup=args.warmup,
        )
    )
    print(format_report(report))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
