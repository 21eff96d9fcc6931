"""Serving load: streamed `POST /v1/completions` against any OpenAI-compatible server.

The load itself is `pagedserve bench serve`'s (server/bench/load.py, which says what each
latency measures); this keeps the flags the bench/ scripts pass: random token ids in
[1000, --vocab-size), exactly `--output-len` tokens each (`ignore_eos`, greedy).

    python bench/serving/serve_load.py [--base-url http://127.0.0.1:8000] [--num-requests 64]
        [--concurrency 16 | --request-rate 4] [--input-len 128] [--output-len 64] [--out r.json]

As a library: `await run_load(base_url=..., num_requests=..., ...)` returns the same dict that
`--out` writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

# The repository root, for a checkout whose package is not installed (the GPU machines').
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.bench.load import format_report, run_load
from server.bench.workload import LOW_TOKEN_ID, WorkItem, make_workload, warmup_workload

__all__ = ["WorkItem", "format_report", "make_workload", "run_load", "warmup_workload"]


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
