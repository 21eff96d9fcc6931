"""The engine step on a CPU against context length: prefill tokens/s and decode step time, with
the decode step split into attention, the rest of the model, and the host (schedule, batch,
sample, detokenize), and set against this machine's memory-bandwidth floor.

    python bench/cpu/cpu_step.py [MODEL_DIR] [--configs float32:torch:eager,bfloat16:torch:eager,bfloat16:torch,bfloat16:cpu]
        [--contexts 128,512,2048,8160] [--batch 16] [--long-batch 4] [--steps 16] [--block-size 16]

Each config (dtype:attention backend, `:eager` for --enforce-eager: bf16 weights not prepacked;
`:python`: the layers' Python loop instead of the CPU backend's C++ one) runs every context in a
fresh engine, one after the other
in one process: B requests of C random prompt tokens (B = --long-batch from 8000 tokens on) are
prefilled together (prefill tok/s = B*C / time to every first token), then --steps decode steps
of all B are timed. floor = (weight bytes + KV bytes of every sequence's context) / bandwidth,
bandwidth = bytes read + written per second of a 1 GiB tensor copy in torch (measured here).
Attention is timed around the backend's forward, which the C++ layer loop does not call: its
rows show none (the same kernel runs in its `:python` row).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cpu.roofline import copy_bandwidth
from engine import LLM, SamplingParams


class Timer:
    """Wraps a method and adds up the seconds spent in it."""

    def __init__(self, owner: object, name: str) -> None:
        self.seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def run(
    model_dir: Path | None,
    dtype: str,
    backend: str,
    mode: str,
    block_size: int,
    context: int,
    batch: int,
    steps: int,
    bandwidth: float,
) -> dict:
    max_len = context + steps + 8
    llm = LLM(
        None if model_dir is None else str(model_dir),
        dtype=dtype,
        attention_backend=backend,
        enforce_eager=mode == "eager",
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        block_size=block_size,
        num_kv_blocks=batch * -(-max_len // block_size),
    )
    engine = llm.engine
    if mode == "python":
        engine.executor.runner.model.layers_runner = None
    stacked = engine.executor.runner.model.layers_runner is not None
    llm.generate(
        [[1000] * 64] * 2, SamplingParams(max_tokens=2)
    )  # warm-up: first calls pay one-off costs
    rng = random.Random(context)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(1000, min(40000, engine.info.vocab_size)) for _ in range(context)]
        engine.add_request(prompt, params, prompt_token_ids=prompt)
    started, first = time.perf_counter(), set()
    while len(first) < batch:
        first |= {o.request_id for o in engine.step()}
    prefill_s = time.perf_counter() - started
    runner = engine.executor.runner
    attention, execute = Timer(runner.backend, "forward"), Timer(runner, "execute")
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_s = (time.perf_counter() - started) / steps
    model = runner.model
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *packed])
    kv = batch * (context + steps / 2) * engine.spec.kv_bytes_per_block / engine.spec.block_size
    floor_s = (weights + kv) / bandwidth
    del llm
    gc.collect()
    return {
        "context": context,
        "batch": batch,
        "prefill_tok_s": batch * context / prefill_s,
        "step_ms": step_s * 1e3,
        "attention_ms": None if stacked else attention.seconds / steps * 1e3,
        "model_ms": (execute.seconds - attention.seconds) / steps * 1e3,
        "host_ms": (step_s * steps - execute.seconds) / steps * 1e3,
        "floor_ms": floor_s * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", nargs="?", type=Path, default=None)
    parser.add_argument(
        "--configs", default="float32:torch:eager,bfloat16:torch:eager,bfloat16:torch,bfloat16:cpu"
    )
    parser.add_argument("--contexts", default="128,512,2048,8160")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--long-batch", type=int, default=4, help="requests from 8000 tokens of context on"
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    model = "the default model" if args.model_dir is None else args.model_dir.name
    print(f"{model}, {torch.get_num_threads()} threads, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(
        "| dtype | attention | weights | layers | context | requests | prefill tok/s | decode step ms | attention ms | "
        "rest of model ms | host ms | floor ms | step / floor |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in args.configs.split(","):
        dtype, backend, mode = (config + ":").split(":")[:3]
        weights = "prepacked" if dtype == "bfloat16" and mode != "eager" else "as loaded"
        layers = "C++" if backend == "cpu" and mode == "" else "Python"
        for context in (int(c) for c in args.contexts.split(",")):
            batch = args.batch if context < 8000 else args.long_batch
            r = run(
                args.model_dir,
                dtype,
                backend,
                mode,
                args.block_size,
                context,
                batch,
                args.steps,
                bandwidth,
            )
            attention = "-" if r["attention_ms"] is None else f"{r['attention_ms']:.1f}"
            print(
                f"| {dtype} | {backend} | {weights} | {layers} | {context} | {batch} | {r['prefill_tok_s']:.0f} | "
                f"{r['step_ms']:.1f} | {attention} | {r['model_ms']:.1f} | {r['host_ms']:.1f} | {r['floor_ms']:.1f} | "
                f"{r['step_ms'] / r['floor_ms']:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
