"""Offline reference for the serving load: the same prompts and lengths through `LLM.generate`.

`serve_load.py` measures a server; this runs the identical workload (same token ids, same output
lengths, greedy, EOS ignored) in-process with pagedserve's offline API, so that

    frontend overhead ratio = server output tok/s / offline output tok/s

tells how much the HTTP frontend, streaming and the engine thread hand-off cost. Give the engine
the server's settings; `--max-num-seqs` equal to the load's concurrency makes the offline run
keep as many sequences in flight as the closed loop does.

    python bench/serving/offline_same_workload.py [MODEL_DIR] [--num-requests 64] [--input-len 128]
        [--output-len 64] [--max-num-seqs 16] [--out offline.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load, when imported from elsewhere

from serve_load import WorkItem, add_workload_args, make_workload, warmup_workload

from config.engine_config import ENGINE_SECTIONS
from config.sources import add_flags
from engine import LLM, SamplingParams

# The engine's settings, flags named as `pagedserve serve` names them; --seed is the workload's.
ENGINE_SETTINGS = {
    name for section in ENGINE_SECTIONS.values() for name in section.model_fields
} - {"seed"}


def run_offline(llm: LLM, workload: list[WorkItem], warmup: list[WorkItem] | None = None) -> dict:
    """Generate the whole workload at once and time it; output tokens/s counts the asked-for tokens.

    `warmup` runs first, unmeasured (first-call allocation and kernel selection are not
    throughput; the serving load warms up the same way, with the same prompts).
    """
    params = [
        SamplingParams(temperature=0, max_tokens=item.output_len, ignore_eos=True)
        for item in workload
    ]
    prompts = [item.prompt_ids for item in workload]
    if warmup:
        llm.generate(
            [w.prompt_ids for w in warmup],
            [
                SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
                for w in warmup
            ],
        )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "duration_s": seconds,
        "completed": len(outputs),
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": produced,
        "length_mismatches": sum(
            1
            for o, item in zip(outputs, workload)
            if len(o.outputs[0].token_ids) != item.output_len
        ),
        "request_throughput": len(outputs) / seconds,
        "output_throughput": produced / seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder (default: the bundled SmolLM2-135M-Instruct)",
    )
    add_workload_args(parser)
    # Only the settings given reach the engine: the rest keep its defaults.
    add_flags(parser, ENGINE_SECTIONS, skip=("model", "seed"))
    parser.set_defaults(max_num_seqs=16)  # match the load's --concurrency
    parser.add_argument("--out", default=None, help="write the report as JSON")
    args = parser.parse_args()

    workload = make_workload(
        args.num_requests,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.vocab_size,
        args.seed,
    )
    settings = {name: value for name, value in vars(args).items() if name in ENGINE_SETTINGS}
    llm = LLM(**settings)  # the positional MODEL is the `model` setting
    report = run_offline(
        llm, workload, warmup_workload(1, args.input_len, args.vocab_size, args.seed)
    )
    report["config"] = {
        "model": str(llm.engine.model_path),
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
        "engine": settings,
    }
    print(
        f"== offline LLM.generate | {llm.engine.model_path.name} | {report['completed']} requests | "
        f"in {args.input_len} out {args.output_len} (range {args.range_ratio:g}) | {settings}"
    )
    print(
        f"duration {report['duration_s']:.2f} s | {report['request_throughput']:.2f} req/s | "
        f"{report['output_throughput']:.1f} output tok/s | length mismatches {report['length_mismatches']}"
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
