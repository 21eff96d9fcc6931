"""The fused CPU elementwise ops (kernels/cpu/fused_ops.cpp) at a decode step's and a prefill
step's row counts, in the default model's shapes (hidden 576, intermediate 1536, 9/3 heads of
64), bfloat16, against a copy of silu_mul's output size (what a memory-bound op would cost).

    python bench/cpu/cpu_fused_ops.py [--rows 16,2048] [--repeats 50]

Run it from the checkout to measure (it imports that checkout's kernels).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.cpu import fused_ops

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def mean_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):  # warm-up: first calls pay one-off costs
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def measure(rows: int, repeats: int) -> dict[str, float]:
    bf16 = torch.bfloat16
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(bf16)
    x, residual = torch.randn(rows, HIDDEN).to(bf16), torch.randn(rows, HIDDEN).to(bf16)
    weight = torch.randn(HIDDEN).to(bf16)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(bf16)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    cos, sin = torch.randn(rows, HEAD_DIM).to(bf16), torch.randn(rows, HEAD_DIM).to(bf16)
    out_sized = torch.randn(rows, INTERMEDIATE).to(bf16)
    return {
        "silu_mul": mean_ms(lambda: fused_ops.silu_mul(gate_up), repeats),
        "copy of its output": mean_ms(out_sized.clone, repeats),
        "rms_norm": mean_ms(lambda: fused_ops.rms_norm(x, weight, 1e-5), repeats),
        "add_rms_norm": mean_ms(lambda: fused_ops.add_rms_norm(x, residual, weight, 1e-5), repeats),
        "rotary q": mean_ms(lambda: fused_ops.rotary_(q, cos, sin), repeats),
        "rotary k": mean_ms(lambda: fused_ops.rotary_(k, cos, sin), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="16,2048")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    results = {int(r): measure(int(r), args.repeats) for r in args.rows.split(",")}
    names = list(next(iter(results.values())))
    print(f"{torch.get_num_threads()} threads, bfloat16, mean ms of {args.repeats} calls")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for rows, times in results.items():
        print(f"| {rows} | " + " | ".join(f"{times[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
