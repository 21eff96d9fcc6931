"""CPU attention per layer: the C++ kernels (`--attention-backend cpu`) against the torch
reference (gather, pad, mask, SDPA), on the same steps, one after the other in one process; for
steps with prefill chunks past 32 rows also the cpu backend with those chunks on torch's flash
SDPA instead of the bf16 prefill kernel (what it does where torch's bf16 micro-kernel does not
run, or in float32).

    python bench/cpu/cpu_attention.py [--threads 2] [--dtype bfloat16] [--heads 9 --kv-heads 3 --dim 64]

Each case is one step of B requests with a context of C tokens each, Q new rows per request
(Q = 1: decode; Q > 1: a prefill chunk after C - Q cached tokens), KV blocks shuffled in the
pool. Reported: mean milliseconds of one layer's attention call (the reference's per-step plan
is made once per step and shared by --layers calls, as in the engine) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.attention.backend import AttentionMetadata
from kernels.attention.cpu_backend import KERNEL_MAX_QUERY_LEN, CpuPagedBackend
from kernels.attention.torch_ref import TorchReferenceBackend

# (requests, context, new rows per request)
CASES = [
    (16, 128, 1),
    (16, 512, 1),
    (16, 2048, 1),
    (4, 8192, 1),
    (8, 128, 128),
    (1, 1024, 1024),
    (2, 1024, 1024),
    (1, 2048, 512),
]


def make_step(
    batch: int,
    context: int,
    rows: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
) -> tuple:
    per_request = -(-context // block_size)
    num_blocks = batch * per_request + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = (
        (torch.randperm(num_blocks - 1)[: batch * per_request] + 1).view(batch, per_request).int()
    )
    positions = torch.arange(context - rows, context)
    slots = (
        tables.long()[:, positions // block_size] * block_size + positions % block_size
    ).flatten()
    meta = AttentionMetadata(
        slots,
        tables,
        torch.arange(0, batch * rows + 1, rows, dtype=torch.int32),
        torch.full((batch,), context, dtype=torch.int32),
        [rows] * batch,
        [context] * batch,
    )
    q = torch.randn(batch * rows, heads, dim, dtype=dtype)
    k = torch.randn(batch * rows, kv_heads, dim, dtype=dtype)
    return q, k, torch.randn_like(k), k_cache, v_cache, meta


def time_ms(backend, step: tuple, repeats: int, layers: int) -> float:
    """Per layer, with a backend's per-step plan made once for `layers` layers, as in a step."""
    q, k, v, k_cache, v_cache, meta = step
    meta.backend_plan = None  # each backend makes its own
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        meta.backend_plan = None
        for _ in range(layers):
            backend.forward(q, k, v, k_cache, v_cache, meta, 0.125)
    return (time.perf_counter() - start) / (repeats * layers) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=9, help="default: the default model's")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block-sizes", default="16,128")
    parser.add_argument(
        "--layers",
        type=int,
        default=30,
        help="layers sharing one step's plan (the default model's 30)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.dtype}, {args.heads}/{args.kv_heads} heads of {args.dim}, {args.threads} threads; ms per layer"
    )
    print(
        "| requests x context, new rows | block | torch reference | cpu, long chunks on SDPA "
        "| cpu | speed-up | prefill kernel / SDPA |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for batch, context, rows in CASES:
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            step = make_step(
                batch, context, rows, block_size, args.heads, args.kv_heads, args.dim, dtype
            )
            repeats = 3 if rows == 1 else 1
            ref = time_ms(TorchReferenceBackend(), step, repeats, args.layers)
            cpu = time_ms(CpuPagedBackend(), step, repeats, args.layers)
            sdpa, gain = "-", "-"
            if rows > KERNEL_MAX_QUERY_LEN:
                ms = time_ms(CpuPagedBackend(prefill_kernel=False), step, repeats, args.layers)
                sdpa, gain = f"{ms:.2f}", f"{ms / cpu:.2f}x"
            print(
                f"| {batch} x {context}, {rows} | {block_size} | {ref:.2f} | {sdpa} | {cpu:.2f} "
                f"| {ref / cpu:.2f}x | {gain} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
