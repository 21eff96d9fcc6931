"""Random paged-attention steps, and a check of any backend against the torch reference on them.

A step mixes decode rows with ragged context lengths, a whole prompt, a first chunk, and chunks
after a cached prefix (one ending mid-block, one spanning several tiles); the cache holds each
request's earlier tokens in shuffled blocks, block 0 left unused so that a table pad reads it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.torch_ref import TorchReferenceBackend


def random_step(
    gen: torch.Generator,
    rng: random.Random,
    shapes: list[tuple[int, int]],
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step over requests of (context_len, query_len): the cache holds every request's
    earlier tokens in shuffled blocks; q, k, v are the step's new rows."""
    tables = []
    blocks_needed = [-(-ctx // block_size) for ctx, _ in shapes]
    order = list(range(1, sum(blocks_needed) + 1))  # block 0 stays unused: a table pad reads it
    rng.shuffle(order)
    it = iter(order)
    for n in blocks_needed:
        tables.append([next(it) for _ in range(n)])
    num_blocks = sum(blocks_needed) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    width = max(blocks_needed)
    table_tensor = torch.zeros(len(shapes), width, dtype=torch.int32)
    slots, cu = [], [0]
    for i, ((ctx, q_len), table) in enumerate(zip(shapes, tables)):
        table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)
        ]
        cu.append(cu[-1] + q_len)
    tokens = cu[-1]
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=table_tensor,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seqlens_k=torch.tensor([ctx for ctx, _ in shapes], dtype=torch.int32),
        query_lens=[q_len for _, q_len in shapes],
        context_lens=[ctx for ctx, _ in shapes],
    )
    return q, k, v, torch.stack([k_cache, v_cache]), meta


# (context length, query length): decodes with ragged contexts, a whole prompt, a first chunk,
# and chunks after a cached prefix (one ending mid-block, one spanning several tiles).
SHAPES = [(1, 1), (37, 1), (300, 1), (16, 1), (23, 23), (40, 17), (150, 70), (290, 33)]

# Decodes only (the steps CUDA graphs replay), one context past 512.
DECODES = [(1, 1), (37, 1), (300, 1), (16, 1), (513, 1)]


def check_against_reference(
    make_backend: Callable[[], AttentionBackend],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    shapes: list[tuple[int, int]] = SHAPES,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    atol: float = 2e-5,
) -> None:
    """The backend's output and cache after one step equal the reference's (the cache bitwise)."""
    seed = hash((heads, kv_heads, dim, block_size, len(shapes))) % 2**31
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    shapes = rng.sample(shapes, len(shapes))  # decodes and chunks interleaved in the batch
    q, k, v, caches, meta = random_step(gen, rng, shapes, block_size, heads, kv_heads, dim)
    q, k, v, caches = (t.to(device, dtype) for t in (q, k, v, caches))
    meta = AttentionMetadata(
        meta.slot_mapping.to(device),
        meta.block_tables.to(device),
        meta.cu_seqlens_q.to(device),
        meta.seqlens_k.to(device),
        meta.query_lens,
        meta.context_lens,
    )
    scale = dim**-0.5
    want_caches, got_caches = caches.clone(), caches.clone()
    want = TorchReferenceBackend().forward(q, k, v, want_caches[0], want_caches[1], meta, scale)
    meta.backend_plan = None
    got = make_backend().forward(q, k, v, got_caches[0], got_caches[1], meta, scale)
    assert torch.equal(got_caches, want_caches)  # the new tokens were stored alike
    torch.testing.assert_close(
        got, want, atol=atol, rtol=1e-5 if dtype == torch.float32 else 1.6e-2
    )
