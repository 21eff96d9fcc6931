"""A decode step's attention on the CPU, as the engine meets it: every layer's cache its own (so
a step reads more than the last-level cache holds, unlike `cpu_attention.py`, which reuses one
layer's), on huge pages like the engine's pool, blocks in order or shuffled. Reports the median
time of all layers' `paged_attention` calls and the bytes of K and V they read per second,
beside a plain read of the same bytes (the machine's read bandwidth).

    python bench/cpu/cpu_decode_attention.py [--requests 16] [--contexts 128,1056,2048] [--layers 30]
        [--dtype bfloat16] [--block-size 32] [--heads 9 --kv-heads 3 --dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.cpu.huge_pages import huge_page_zeros
from kernels.cpu.paged_attention_op import DECODES_ON_TILES, paged_attention


def median_seconds(run: object, repeats: int) -> float:
    assert callable(run)
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def one_case(args: argparse.Namespace, context: int, shuffled: bool) -> tuple[float, float]:
    """(milliseconds for all layers, bytes of K and V read)."""
    dtype = getattr(torch, args.dtype)
    blocks = -(-context // args.block_size)
    shape = (args.requests * blocks, args.block_size, args.kv_heads, args.dim)
    numel = torch.Size(shape).numel()
    caches = []
    for _ in range(args.layers):
        k = huge_page_zeros(numel, dtype).view(shape)
        v = huge_page_zeros(numel, dtype).view(shape)
        k.normal_(), v.normal_()
        caches.append((k, v))
    order = (
        torch.randperm(args.requests * blocks) if shuffled else torch.arange(args.requests * blocks)
    )
    tables = order.to(torch.int32).view(args.requests, blocks).contiguous()
    cu_seqlens_q = torch.arange(args.requests + 1, dtype=torch.int32)
    seqlens_k = torch.full((args.requests,), context, dtype=torch.int32)
    q = torch.randn(args.requests, args.heads, args.dim).to(dtype)
    out = torch.empty_like(q)
    scale = args.dim**-0.5

    def step() -> None:
        for k, v in caches:
            paged_attention(out, q, k, v, tables, cu_seqlens_q, seqlens_k, scale)

    read = 2 * args.layers * args.requests * context * args.kv_heads * args.dim * dtype.itemsize
    return median_seconds(step, args.repeats) * 1e3, read


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of a plain read of `nbytes` (a sum over int64 words, all threads)."""
    data = huge_page_zeros(nbytes // 8, torch.int64)
    data.fill_(1)
    return nbytes / median_seconds(lambda: data.sum(), repeats) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--contexts", default="128,1056,2048")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.requests} decode rows, {args.heads}/{args.kv_heads} heads of {args.dim}, "
        f"{args.layers} layers, {args.dtype}, blocks of {args.block_size}, {args.threads} threads; "
        f"AMX tiles: {'yes' if DECODES_ON_TILES else 'no'}; "
        f"plain read {read_bandwidth(400 << 20, 5):.1f} GB/s"
    )
    print("| context | blocks | step ms | GB/s of K and V |")
    print("|---:|---|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        for shuffled in (False, True):
            ms, read = one_case(args, context, shuffled)
            order = "shuffled" if shuffled else "in order"
            print(f"| {context} | {order} | {ms:.2f} | {read / ms / 1e6:.1f} |")


if __name__ == "__main__":
    main()
