"""`pagedserve bench throughput`: the benchmark's datasets through the offline engine
(`engine.LLM`), reporting request and token throughput, with `vllm bench throughput`'s flag
names. A multi-turn dataset runs turn by turn: every conversation's first turn in one
`generate`, then every second turn with the first answers in its history, and so on."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from config.engine_config import ENGINE_SECTIONS
from config.sources import add_flags, merge
from server.bench.dataset_flags import (
    add_dataset_flags,
    build_dataset,
    check_dataset_flags,
    dataset_config,
)
from server.bench.datasets import Conversation, completion_prompt
from server.bench.workload import LOW_TOKEN_ID

# --seed is the dataset's (the engine samples greedily here), so it is not one of these.
ENGINE_SETTINGS = {
    name for section in ENGINE_SECTIONS.values() for name in section.model_fields
} - {"seed"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "throughput",
        help="measure the offline engine's throughput",
        description="Run a dataset through the offline engine (engine.LLM) and report request "
        "and token throughput. Engine settings: the flags of `pagedserve serve`.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local model folder or Hub id (default: the bundled SmolLM2-135M-Instruct)",
    )
    add_dataset_flags(parser)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max_tokens even past end-of-sequence",
    )
    parser.add_argument(
        "--output-json", type=Path, default=None, help="write the result as JSON to this file"
    )
    parser.add_argument("--config", type=Path, default=None, help="YAML file of engine settings")
    engine = parser.add_argument_group("engine")
    add_flags(engine, ENGINE_SECTIONS, skip=("model", "seed"))  # type: ignore[arg-type]
    parser.set_defaults(bench_main=main, bench_parser=parser)
    return parser


def run_throughput(llm: Any, conversations: list[Conversation], ignore_eos: bool) -> dict[str, Any]:
    """Every conversation through `llm.generate`, a turn at a time; the timed part is the
    generate calls. Output tokens count what the engine generated."""
    from engine import SamplingParams

    answers: list[list[str]] = [[] for _ in conversations]
    input_tokens = output_tokens = requests = 0
    seconds = 0.0
    for turn in range(max(len(c.turns) for c in conversations)):
        live = [i for i, c in enumerate(conversations) if turn < len(c.turns)]
        prompts = [completion_prompt(conversations[i], answers[i]) for i in live]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=conversations[i].turns[turn].output_len,
                ignore_eos=ignore_eos,
            )
            for i in live
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds += time.perf_counter() - start
        for i, output in zip(live, outputs):
            answers[i].append(output.outputs[0].text)
            input_tokens += len(output.prompt_token_ids)
            output_tokens += len(output.outputs[0].token_ids)
        requests += len(live)
    return {
        "elapsed_time": seconds,
        "num_requests": requests,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": requests / seconds,
        "tokens_per_second": (input_tokens + output_tokens) / seconds,
        "output_tokens_per_second": output_tokens / seconds,
    }


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from engine import LLM, SamplingParams

    check_dataset_flags(args, parser)
    given = {name: value for name, value in vars(args).items() if name in ENGINE_SETTINGS}
    settings = merge(given, os.environ, args.config, ENGINE_SECTIONS)
    with LLM(**settings) as llm:
        conversations = build_dataset(args, llm.tokenizer, as_text=False)
        # Unmeasured: first-call allocation and kernel selection are not throughput.
        llm.generate([[LOW_TOKEN_ID] * 8], SamplingParams(max_tokens=2))
        result = run_throughput(llm, conversations, args.ignore_eos)
        model = str(llm.engine.model_path)
    result["config"] = dataset_config(args) | {"model": model, "ignore_eos": args.ignore_eos}
    result["config"]["engine"] = {k: v for k, v in given.items() if k != "model"}
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({result['num_requests']} requests, {result['total_input_tokens']} input and "
        f"{result['total_output_tokens']} output tokens in {result['elapsed_time']:.2f} s)"
    )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {args.output_json}")
    return 0
