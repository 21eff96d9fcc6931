"""Decode step time and tok/s of quantized weights against bf16, side by side in one process:
the default model as bf16, as int8 (--quantization int8) and from its own GGUF file's Q4_1
blocks (--quantization gguf); the 124.7M random Llama (bench/models/random_llama.py) as bf16 and int8,
and, with --gguf, GGUF files of its shape in other block types (bench/models/random_gguf.py: random
blocks, K-quants among them). int8 and every GGUF format also as FORMAT+a8: its linears with
int8 activations (--quantize-activations int8; int8+a8 is W8A8), unless --no-a8.
Every engine is loaded, their runs alternated round by round so that a loaded machine slows them
alike; and each one's resident memory, from a fresh process per format.

    python bench/models/random_llama.py                # once: ~/.cache/pagedserve/random-llama-124m
    python bench/models/quantized.py [--models default,random] [--batches 1,16] [--steps 24] [--rounds 5]
    python bench/models/random_gguf.py q4_k_m          # once per mix: ~/.cache/pagedserve/random-llama-124m-MIX.gguf
    python bench/models/quantized.py --models random --gguf q4_k_m=FILE,q4_1=FILE

A round, per batch size B and format: B requests of --context random prompt tokens are
prefilled, then --steps decode steps of all B are timed (the engine's own step: schedule, the
model, sample). Reported: the best and the median round's step time, B / best step as tok/s,
and the ratio of bf16's best step to the format's (on a loaded machine the best rounds are the
least disturbed ones).
Resident memory: VmRSS of a process that loaded the format's engine and generated one token,
after malloc_trim; weights: the bytes of the model's parameters and packed/quantized copies.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config import ConfigError
from engine import LLM, SamplingParams

RANDOM_LLAMA = Path.home() / ".cache" / "pagedserve" / "random-llama-124m"
FORMATS = {"bf16": None, "int8": "int8", "gguf": "gguf"}
# A format: (model, --quantization, --quantize-activations).
Format = tuple[str | None, str | None, str | None]


def formats(name: str, files: dict[str, str], a8: bool) -> dict[str, Format]:
    """Each format's settings: the random Llama has no GGUF file of its own weights, but --gguf
    files of its shape. With `a8`, int8 and each GGUF one again with int8 activations."""
    if name == "default":
        table: dict[str, Format] = {f: (None, q, None) for f, q in FORMATS.items()}
        gguf: dict[str, tuple[str | None, str | None]] = {"gguf": (None, "gguf")}
    else:
        model = model_path(name)
        table = {f: (model, q, None) for f, q in FORMATS.items() if f != "gguf"}
        gguf = {f: (path, None) for f, path in files.items()}
    table |= {f: (m, q, None) for f, (m, q) in gguf.items()}
    if a8:
        int8 = {"int8": (table["int8"][0], "int8")}
        table |= {f"{f}+a8": (m, q, "int8") for f, (m, q) in (int8 | gguf).items()}
    return table


def model_path(name: str) -> str | None:
    if name == "default":
        return None
    if not (RANDOM_LLAMA / "config.json").is_file():
        sys.exit(f"no {RANDOM_LLAMA}: run python bench/models/random_llama.py first")
    return str(RANDOM_LLAMA)


def engine(fmt: Format, batch: int, max_len: int) -> LLM:
    model, quantization, activations = fmt
    return LLM(
        model,
        dtype="bfloat16",
        quantization=quantization,
        quantize_activations=activations,
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        num_kv_blocks=batch * -(-max_len // 16) + 8,
    )


def decode_step_s(llm: LLM, batch: int, context: int, steps: int, seed: int) -> float:
    """Seconds per decode step of `batch` requests after their prefill."""
    eng = llm.engine
    rng = random.Random(seed)
    vocab = min(32000, eng.info.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        eng.add_request(prompt, params, prompt_token_ids=prompt)
    first: set[str] = set()
    while len(first) < batch:
        first |= {o.request_id for o in eng.step()}
    started = time.perf_counter()
    for _ in range(steps):
        eng.step()
    elapsed = (time.perf_counter() - started) / steps
    while eng.has_unfinished_requests():
        eng.step()
    return elapsed


def weight_mib(llm: LLM) -> float:
    """Bytes of every tensor the model keeps: parameters, packed and quantized weights."""
    model = cast(torch.nn.Module, llm.engine.executor.runner.model)
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        for name in ("packed", "lm_head_packed"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and not t.is_mkldnn:
                tensors.append(t)
        for name in ("quantized", "lm_head_quantized"):
            q = getattr(module, name, None)
            if q is not None:
                tensors += [q.q, q.scales] + ([] if q.mins is None else [q.mins])
    return sum(t.untyped_storage().nbytes() for t in tensors) / 2**20


def resident_mib(model: str, quantization: str | None, activations: str | None) -> float:
    """VmRSS of a fresh process that loaded the engine and generated a token."""
    code = f"""
import ctypes, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from engine import LLM, SamplingParams
llm = LLM({model!r} if {model!r} != "default" else None, dtype="bfloat16",
          quantization={quantization!r}, quantize_activations={activations!r},
          max_model_len=256, num_kv_blocks=64)
llm.generate([[100, 200, 300]], SamplingParams(max_tokens=1))
# What the process holds, not what the allocator kept of the load's temporaries (the bf16 copy a
# weight was quantized from): pagedserve keeps freed memory for its steps' activations.
ctypes.CDLL("libc.so.6").malloc_trim(0)
for line in open("/proc/self/status"):
    if line.startswith("VmRSS"):
        print(int(line.split()[1]) / 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="default,random")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-a8", action="store_true", help="no FORMAT+a8 variants")
    parser.add_argument(
        "--gguf", default="", help="NAME=FILE,...: GGUF files timed beside the random Llama"
    )
    args = parser.parse_args()
    files = dict(spec.split("=", 1) for spec in args.gguf.split(",") if spec)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.steps + 8
    rows = []
    for name in args.models.split(","):
        table = formats(name, files, not args.no_a8)
        llms = {}
        for fmt, settings in list(table.items()):
            try:
                llms[fmt] = engine(settings, max(batches), max_len)
            except ConfigError as exc:  # +a8 where it cannot run: no VNNI, no linear in 32s
                if settings[2] is None:
                    raise
                print(f"{name} {fmt}: skipped ({exc})", file=sys.stderr)
                del table[fmt]
        weights = {fmt: weight_mib(llm) for fmt, llm in llms.items()}
        for llm in llms.values():  # warm-up: first calls pay one-off costs
            decode_step_s(llm, max(batches), args.context, 4, seed=0)
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            order = list(llms)[r % len(llms) :] + list(llms)[: r % len(llms)]  # each first in turn
            for batch in batches:
                for fmt in order:
                    step = decode_step_s(llms[fmt], batch, args.context, args.steps, seed=r)
                    times.setdefault((fmt, batch), []).append(step)
        del llms
        memory = {}
        if not args.no_memory:
            for fmt, (m, q, a) in table.items():
                memory[fmt] = resident_mib(name if m is None else m, q, a)
        for batch in batches:
            base = min(times[("bf16", batch)])
            for fmt in table:
                step = min(times[(fmt, batch)])
                rows.append(
                    {
                        "model": name,
                        "format": fmt,
                        "batch": batch,
                        "step_ms": round(step * 1e3, 2),
                        "median_ms": round(statistics.median(times[(fmt, batch)]) * 1e3, 2),
                        "tok_s": round(batch / step, 1),
                        "speedup": round(base / step, 2),
                        "rss_mib": round(memory[fmt]) if memory else None,
                        "weights_mib": round(weights[fmt]),
                        "all_ms": [round(t * 1e3, 2) for t in times[(fmt, batch)]],
                    }
                )
    print(
        "| model | weights | requests | decode step ms, best | median | tok/s | vs bf16 "
        "| weights MiB | resident MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['model']} | {row['format']} | {row['batch']} | {row['step_ms']} | "
            f"{row['median_ms']} | "
            f"{row['tok_s']} | {row['speedup']}x | {row['weights_mib']} | {row['rss_mib']} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
