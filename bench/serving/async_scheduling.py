"""Async scheduling on and off, side by side, offline: output tokens/s of `LLM.generate`.

    python bench/serving/async_scheduling.py [--model DIR] [--batches 1 16 64] [--rounds 2]

Each batch size is one workload: that many requests at once, a 128-token prompt each (random
words of the real tokenizer), 64 tokens out, greedy with EOS ignored, `max_num_seqs` = the batch.
The engines are built once each (off, then on) and the workloads alternate between them, off
first in even rounds and on first in odd ones, so that drift on a shared machine falls on both.
`--model tiny` runs a one-layer Llama of width 32, whose forward costs next to nothing: its steps
are the engine's host work, what async scheduling hides on a GPU.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams

PROMPT_LEN, OUTPUT_LEN = 128, 64


def prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    return [[rng.randrange(100, vocab - 1) for _ in range(PROMPT_LEN)] for _ in range(count)]


def tok_s(llm: LLM, batch: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    work = prompts(llm, batch, seed)
    started = time.perf_counter()
    outputs = llm.generate(work, params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outputs)
    return batch * OUTPUT_LEN / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder, 'tiny', or the default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    model = args.model
    if model == "tiny":
        from bench.cpu.host_step import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp())))
    settings = {
        "dtype": args.dtype if args.model != "tiny" else "float32",
        "max_model_len": PROMPT_LEN + OUTPUT_LEN + 16,
        "max_num_seqs": max(args.batches),
        "max_num_batched_tokens": max(2048, max(args.batches) * PROMPT_LEN),
    }
    engines = {flag: LLM(model, async_scheduling=flag, **settings) for flag in (False, True)}
    for llm in engines.values():  # warm-up: first-call kernel and allocator costs
        tok_s(llm, 2, seed=-1)
    print(f"{platform.processor() or platform.machine()}, model {args.model or 'default'}")
    print("| batch | round | off tok/s | on tok/s | on/off |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {flag: tok_s(engines[flag], batch, seed=r) for flag in order}
            print(
                f"| {batch} | {r} | {got[False]:.1f} | {got[True]:.1f} | "
                f"{got[True] / got[False]:.3f} |",
                flush=True,
            )
    for llm in engines.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
