"""`pagedserve bench`: its subcommands' parsers, each of which says how it runs."""

from __future__ import annotations

import argparse
from typing import Any

from server.bench import serve_command, throughput_command


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark a server (bench serve) or the offline engine (bench throughput)",
        description="Benchmarks shaped like `vllm bench serve` and `vllm bench throughput`.",
    )
    commands = bench.add_subparsers(dest="bench_command", required=True)
    serve_command.add_parser(commands)
    throughput_command.add_parser(commands)


def run_bench(args: argparse.Namespace) -> int:
    code: int = args.bench_main(args, args.bench_parser)
    return code
