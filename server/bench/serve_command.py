"""`pagedserve bench serve`: load an OpenAI-compatible server (pagedserve, vLLM, llama.cpp's
llama-server, ...) with streamed requests and report latencies and throughput, with
`vllm bench serve`'s flag names."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from server.bench.dataset_flags import (
    add_dataset_flags,
    build_dataset,
    burstiness,
    check_dataset_flags,
    dataset_config,
    non_negative_int,
    positive_int,
    request_rate,
)
from server.bench.datasets import Conversation, Turn, load_tokenizer
from server.bench.load import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    LoadSettings,
    first_model,
    format_report,
    run_conversations,
)

BACKENDS = ("vllm", "openai", "openai-chat")
# vLLM's metric names -> the report's keys.
METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}
DESCRIPTION = (
    "Load an OpenAI-compatible server with streamed requests and report TTFT, TPOT, ITL and "
    "end-to-end latency (mean, median, p99) and request and token throughput. Exits 1 when a "
    "request failed."
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "serve", help="measure a running OpenAI-compatible server", description=DESCRIPTION
    )
    where = parser.add_argument_group("server")
    where.add_argument(
        "--base-url",
        default=None,
        help="the server's URL, e.g. http://10.0.0.5:8000 (over --host/--port)",
    )
    where.add_argument("--host", default="127.0.0.1", help="[default: 127.0.0.1]")
    where.add_argument("--port", type=positive_int, default=8000, help="[default: 8000]")
    where.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="vLLM's name for the API spoken: openai-chat for "
        f"{CHAT_COMPLETIONS}, vllm or openai for {COMPLETIONS}; only checked against --endpoint",
    )
    where.add_argument(
        "--endpoint",
        default=COMPLETIONS,
        help=f"{COMPLETIONS} (prompts) or {CHAT_COMPLETIONS} (messages) [default: {COMPLETIONS}]",
    )
    where.add_argument(
        "--model",
        default=None,
        help="the model to ask for, and its tokenizer (default: the first of GET /v1/models)",
    )
    where.add_argument(
        "--served-model-name", default=None, help="the model name to send, when not --model"
    )
    where.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder or Hub id for the random prompts (default: --model, else "
        "the `root` or `id` GET /v1/models gives)",
    )
    where.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a bearer token [default: $OPENAI_API_KEY]",
    )
    add_dataset_flags(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="most requests in flight (default: no bound)",
    )
    load.add_argument(
        "--request-rate",
        type=request_rate,
        default=math.inf,
        help="arrivals per second, a Poisson process; inf: all at once [default: inf]",
    )
    load.add_argument(
        "--burstiness",
        type=burstiness,
        default=1.0,
        help="with a finite --request-rate, the arrival gaps' gamma shape (mean 1 / rate): 1 is "
        "Poisson, below 1 burstier, above 1 more even [default: 1.0]",
    )
    load.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max_tokens even past end-of-sequence (vLLM's and llama.cpp's ignore_eos)",
    )
    load.add_argument("--temperature", type=float, default=0.0, help="[default: 0, greedy]")
    load.add_argument(
        "--num-warmups",
        type=non_negative_int,
        default=1,
        help="short unmeasured requests sent first [default: 1]",
    )
    load.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="bound on the whole run, seconds (default: none)",
    )
    load.add_argument(
        "--request-timeout", type=float, default=None, help="bound on one request, seconds"
    )
    out = parser.add_argument_group("result")
    out.add_argument("--save-result", action="store_true", help="write the result as JSON")
    out.add_argument("--result-dir", type=Path, default=Path("."), help="[default: .]")
    out.add_argument(
        "--result-filename",
        default=None,
        help="the JSON file's name in --result-dir (implies --save-result)",
    )
    out.add_argument(
        "--percentile-metrics",
        type=metric_names,
        default=tuple(METRICS.values()),
        help="comma-separated metrics to show: ttft, tpot, itl, e2el [default: all four]",
    )
    out.add_argument(
        "--metric-percentiles",
        type=percentiles,
        default=(99.0,),
        help="comma-separated percentiles to show beside mean and median, e.g. 90,99 "
        "(the JSON also has p50, p90 and p99) [default: 99]",
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(bench_main=main, bench_parser=parser)
    return parser


def metric_names(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(METRICS)}, got {text!r}")
    return tuple(METRICS[n] for n in names)


def percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(q) for q in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 90,99, got {text!r}") from None
    if not all(0 < q < 100 for q in values):
        raise argparse.ArgumentTypeError(
            f"percentiles lie strictly between 0 and 100, got {text!r}"
        )
    return values


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_dataset_flags(args, parser)
    endpoint = args.endpoint.rstrip("/")
    if not endpoint.startswith("/") or not endpoint.endswith("completions"):
        parser.error(
            f"--endpoint must be a path ending in completions ({COMPLETIONS} or "
            f"{CHAT_COMPLETIONS}), not {args.endpoint!r}"
        )
    chat = endpoint.endswith("chat/completions")
    if args.backend is not None and (args.backend == "openai-chat") != chat:
        parser.error(f"--backend {args.backend} does not speak --endpoint {args.endpoint}")
    if args.burstiness != 1.0 and math.isinf(args.request_rate):
        parser.error(
            "--burstiness shapes the gaps between arrivals: it needs a finite --request-rate"
        )
    base = args.base_url or f"http://{args.host}:{args.port}"
    if not base.startswith("http://"):
        parser.error(f"--base-url must be an http:// URL, not {base!r}")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check(args, parser)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per GET amid the table
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    settings = LoadSettings(
        base_url=base_url,
        endpoint=args.endpoint,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        timeout=args.timeout,
        request_timeout=args.request_timeout,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        api_key=args.api_key,
        progress=not args.disable_tqdm,
    )
    listed: dict[str, Any] = {}
    needs_tokenizer = args.dataset_name != "custom"
    if args.model is None and (
        args.served_model_name is None or (needs_tokenizer and not args.tokenizer)
    ):
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            listed = asyncio.run(first_model(base_url, headers))
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"pagedserve: error: cannot list {base_url}/v1/models: {exc}", file=sys.stderr)
            return 2
    settings.model = args.served_model_name or args.model or str(listed["id"])
    tokenizer_name = args.tokenizer or args.model or listed.get("root") or listed.get("id")
    tokenizer = load_tokenizer(str(tokenizer_name)) if needs_tokenizer else None
    conversations = build_dataset(args, tokenizer, as_text=settings.chat)
    warmup = build_warmup(args, tokenizer, settings.chat)
    config = dataset_config(args) | {"tokenizer": tokenizer_name if needs_tokenizer else None}
    shown = args.metric_percentiles
    report = asyncio.run(
        run_conversations(conversations, settings, warmup, config, percentiles=shown)
    )
    print(format_report(report, metrics=args.percentile_metrics, percentiles=shown))
    if args.save_result or args.result_filename:
        path = args.result_dir / (args.result_filename or default_filename(settings.model))
        path.parent.mkdir(parents=True, exist_ok=True)
        report["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"result: {path}")
    return 0 if report["failed"] == 0 else 1


def build_warmup(args: argparse.Namespace, tokenizer: Any, as_text: bool) -> list[Conversation]:
    """Short prompts of their own (a measured prompt would find its prefix cached later)."""
    if not args.num_warmups:
        return []
    if tokenizer is None:  # custom: the file's first prompt, asked for a few tokens
        first = build_dataset(args, None, as_text)[0].turns[0]
        return [Conversation([Turn(first.prompt, 4)])] * args.num_warmups
    warm = argparse.Namespace(**vars(args))
    warm.dataset_name, warm.num_prompts, warm.seed = "random", args.num_warmups, args.seed + 7919
    warm.random_output_len, warm.random_input_len = 4, min(args.random_input_len, 64)
    return build_dataset(warm, tokenizer, as_text)


def default_filename(model: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")
    return f"bench-serve-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
