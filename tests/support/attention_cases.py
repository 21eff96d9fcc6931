"""Random paged-attention steps, and a check of any backend against the torch reference on them.

A step mixes decode rows with ragged context lengths, a whole prompt, a first chunk, and chunks
after a cached prefix (one ending mid-block, one spanning several tiles); the cache holds each
request's earlier tokens in shuffled blocks, block 0 left unused so that a table pad reads it.

`naive_attention` is the plainest statement of what a step computes, sliding window and softcap
included, written to be read rather than fast: the torch reference is checked against it, and
every other backend against the torch reference.
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

# Sliding windows against SHAPES' contexts (1 to 300) and blocks of 16: one key (the row itself),
# fewer keys than a block, a window spanning several blocks, and one longer than any context.
WINDOWS = [1, 5, 40, 1000]
# A softcap that barely moves scores of about 1 (Gemma 2's attention value), and one that bites.
SOFTCAPS = [50.0, 2.0]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The step's attention, request by request, in float32, from the cache as it was before the
    step plus the step's own k, v: a row at position p sees the keys at positions j <= p, and
    with a window only those with p - j < sliding_window; scaled scores are capped to
    softcap * tanh(s / softcap) before the mask."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k.shape[1]
    cu = meta.cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for i, ctx in enumerate(meta.seqlens_k.tolist()):
        start, end = cu[i], cu[i + 1]
        cached = ctx - (end - start)  # the positions before the step's rows
        table = meta.block_tables[i].tolist()
        blocks = torch.tensor([table[j // block_size] for j in range(cached)], dtype=torch.long)
        offsets = torch.tensor([j % block_size for j in range(cached)], dtype=torch.long)
        blocks, offsets = blocks.to(q.device), offsets.to(q.device)
        keys = torch.cat([k_cache[blocks, offsets], k[start:end]]).float()  # [ctx, kv_heads, dim]
        values = torch.cat([v_cache[blocks, offsets], v[start:end]]).float()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.arange(cached, ctx, device=q.device).unsqueeze(1)  # the rows' positions
        j = torch.arange(ctx, device=q.device).unsqueeze(0)  # the keys'
        visible = j <= p
        if sliding_window is not None:
            visible &= p - j < sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


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
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The backend's output and cache after one step equal the reference's (the cache bitwise),
    both with `sliding_window` and `softcap` when given."""
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
    options = {"sliding_window": sliding_window, "softcap": softcap}
    want_caches, got_caches = caches.clone(), caches.clone()
    want = TorchReferenceBackend().forward(
        q, k, v, want_caches[0], want_caches[1], meta, scale, **options
    )
    meta.backend_plan = None
    got = make_backend().forward(q, k, v, got_caches[0], got_caches[1], meta, scale, **options)
    assert torch.equal(got_caches, want_caches)  # the new tokens were stored alike
    torch.testing.assert_close(
        got, want, atol=atol, rtol=1e-5 if dtype == torch.float32 else 1.6e-2
    )


# Per layer (sliding window, softcap), as a Gemma-like model alternates them within one step:
# a windowed layer, a global one, then each again and a mix, so that a plan one layer leaves
# on the metadata meets a layer that needs another.
LAYERS = [(40, None), (None, None), (5, 2.0), (40, None), (None, 50.0), (None, None)]


def check_layers_of_one_step(
    make_backend: Callable[[], AttentionBackend],
    layers: list[tuple[int | None, float | None]] = LAYERS,
    shapes: list[tuple[int, int]] = SHAPES,
    device: str = "cpu",
) -> None:
    """One backend runs the layers in turn on one step's metadata (each layer with a cache of its
    own), keeping whatever it plans on it, as the engine does; each layer's output is the naive
    attention with that layer's options."""
    gen, rng = torch.Generator().manual_seed(7), random.Random(7)
    q, k, v, caches, meta = random_step(gen, rng, shapes, 16, 8, 2, 64)
    q, k, v, caches = (t.to(device) for t in (q, k, v, caches))
    meta = AttentionMetadata(
        meta.slot_mapping.to(device),
        meta.block_tables.to(device),
        meta.cu_seqlens_q.to(device),
        meta.seqlens_k.to(device),
        meta.query_lens,
        meta.context_lens,
    )
    backend = make_backend()
    for window, softcap in layers:
        want = naive_attention(q, k, v, caches[0], caches[1], meta, 0.125, window, softcap)
        layer_caches = caches.clone()
        got = backend.forward(
            q,
            k,
            v,
            layer_caches[0],
            layer_caches[1],
            meta,
            0.125,
            sliding_window=window,
            softcap=softcap,
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
