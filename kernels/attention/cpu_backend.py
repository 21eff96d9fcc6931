"""Paged attention on the CPU: decode rows and short chunks through the C++ kernel in kernels/cpu
(one call per layer, keys and values read in place through the block table), long prefill
chunks through a second kernel of blocked bf16 matrix products (AMX or AVX512-BF16) where the
CPU has them and the model runs in bfloat16, else through torch's flash SDPA. New K/V are stored
first, as in every backend.

Why two paths: the kernel computes a row's scores key by key in float32, which is what decode
needs (one row, a context read once) but leaves a long chunk's score matrix to vector code that
is 5-7x slower than blocked bf16 matrix products (1024 fresh rows, 9/3 heads of 64: 23 ms
against 3.2 ms a layer). The prefill kernel (kernels/cpu/prefill_attention.cpp) also reads the
cache in place, one call for all long chunks. On SDPA, a fresh chunk attends to its own K/V with
`is_causal`; a chunk after cached context gathers that context and takes a mask, both planned
once per step (and sliding window).

A sliding window goes to the kernels, which start each row at its first visible key; for SDPA
it is part of the mask (a fresh prompt the window cuts into takes one too), and a chunk after
cached context gathers only the keys its first row's window reaches. SDPA cannot cap scores, so
a layer with a softcap sends every chunk, long ones included, through the kernel: correct, and
its memory stays a tile's, but a long prompt's prefill in such layers runs at the kernel's speed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
from kernels.attention.torch_ref import context_slots, visible_keys
from kernels.cpu.paged_attention_op import paged_attention
from kernels.kv_store import store_kv

try:
    from kernels.cpu import prefill_attention_op
except ImportError:  # not built, or not for this CPU (logged): long chunks take SDPA
    prefill_attention_op = None  # type: ignore[assignment]

# Chunks with more query rows than this go through the prefill kernel or SDPA; at and below it
# the paged kernel is as fast (its 16-row tiles reuse each key while it is in cache) and one call
# covers them all.
KERNEL_MAX_QUERY_LEN = 32
NO_LIMIT = 2**31 - 1  # a query length limit that every chunk is within


@dataclass(frozen=True)
class SdpaChunk:
    rows: slice  # its query rows in the step
    slots: torch.Tensor | None  # [keys] cache slots to gather; None: a fresh prompt's own K/V
    mask: torch.Tensor | None  # [rows, keys] additive mask; None: causal (`is_causal`)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA's additive one: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf")
    )


def _plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None,
) -> list[SdpaChunk]:
    starts = itertools.accumulate(meta.query_lens, initial=0)
    chunks = []
    for i, (start, q_len, ctx) in enumerate(zip(starts, meta.query_lens, meta.context_lens)):
        if q_len <= KERNEL_MAX_QUERY_LEN:
            continue
        rows = slice(start, start + q_len)
        if ctx == q_len:
            if window is None or window >= ctx:  # the window hides nothing
                chunks.append(SdpaChunk(rows, None, None))
            else:
                visible = visible_keys(q_len, ctx, device, window)
                chunks.append(SdpaChunk(rows, None, _additive(visible, dtype)))
            continue
        # The first row's window starts earliest; keys before it are seen by no row.
        first = 0 if window is None else max(0, ctx - q_len + 1 - window)
        visible = visible_keys(q_len, ctx, device, window, first)
        slots = context_slots(meta.block_tables[i], ctx, block_size, first)
        chunks.append(SdpaChunk(rows, slots, _additive(visible, dtype)))
    return chunks


def sdpa_chunks(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None,
) -> list[SdpaChunk]:
    """The chunks of this step that go to SDPA in layers with `window` (no softcap), planned by
    the first such layer of the step."""
    return meta.planned(("cpu", window), lambda: _plan(meta, block_size, dtype, device, window))


def prefill_kernel_takes(dtype: torch.dtype, head_dim: int, softcap: float | None) -> bool:
    """Whether long chunks go to the prefill kernel rather than SDPA."""
    return (
        prefill_attention_op is not None
        and prefill_attention_op.AVAILABLE
        and softcap is None
        and dtype == torch.bfloat16
        and prefill_attention_op.takes_head_dim(head_dim)
    )


def long_chunks(meta: AttentionMetadata) -> int:
    """How many requests of the step have more query rows than the paged kernel takes."""
    return meta.planned(
        ("cpu", "long"), lambda: sum(n > KERNEL_MAX_QUERY_LEN for n in meta.query_lens)
    )


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> [1, heads, tokens, dim], the 4-D layout SDPA's CPU flash kernel
    takes (3-D inputs fall back to its unfused path)."""
    return x.transpose(0, 1).unsqueeze(0)


def one_row_each(meta: AttentionMetadata) -> AttentionMetadata:
    """The step's metadata with every query row a request of its own (seeing its own request's
    keys up to itself), planned once a step. The paged kernel then takes each row through its
    decode path, the path of every generated token: a row's numbers no longer depend on how its
    prompt was cut into chunks, which rows share its step, or whether it is recomputed after a
    preemption (the prefill kernel, SDPA and the tile path each sum in orders of their own)."""

    def make() -> AttentionMetadata:
        lens = torch.tensor(meta.query_lens)
        owner = torch.repeat_interleave(torch.arange(meta.num_reqs), lens)
        seen = [
            pos
            for q_len, ctx in zip(meta.query_lens, meta.context_lens)
            for pos in range(ctx - q_len + 1, ctx + 1)
        ]
        rows = len(seen)
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables.index_select(0, owner.to(meta.block_tables.device)),
            cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=meta.cu_seqlens_q.device),
            seqlens_k=torch.tensor(seen, dtype=torch.int32, device=meta.seqlens_k.device),
            query_lens=[1] * rows,
            context_lens=seen,
        )

    return meta.planned(("cpu", "one_row_each"), make)


class CpuPagedBackend:
    name = "cpu"
    graph_safe = False  # CPU only: there are no CUDA graphs to capture

    def __init__(self, prefill_kernel: bool = True, rows_alone: bool = False) -> None:
        self.prefill_kernel = prefill_kernel  # False: long chunks to SDPA even where it could run
        self.rows_alone = rows_alone  # every row through the decode path (`one_row_each`)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        check_window_and_softcap(sliding_window, softcap)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        _, block_size, kv_heads, dim = k_cache.shape
        chunks: list[SdpaChunk] = []
        max_query_len = NO_LIMIT  # with a softcap the kernel takes every chunk
        long = 0  # chunks for the prefill kernel
        if self.rows_alone:
            meta = one_row_each(meta)
        elif self.prefill_kernel and prefill_kernel_takes(q.dtype, dim, softcap):
            max_query_len, long = KERNEL_MAX_QUERY_LEN, long_chunks(meta)
        elif softcap is None:
            max_query_len = KERNEL_MAX_QUERY_LEN
            chunks = sdpa_chunks(meta, block_size, q.dtype, q.device, sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        if len(chunks) + long < meta.num_reqs:
            paged_attention(
                out,
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.seqlens_k,
                scale,
                max_query_len,
                sliding_window,
                softcap,
            )
        if long:
            prefill_attention_op.prefill_attention(
                out,
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.seqlens_k,
                scale,
                KERNEL_MAX_QUERY_LEN,
                sliding_window,
            )
        for chunk in chunks:
            if chunk.slots is None:
                keys, values = k[chunk.rows], v[chunk.rows]
            else:
                keys = k_cache.view(-1, kv_heads, dim).index_select(0, chunk.slots)
                values = v_cache.view(-1, kv_heads, dim).index_select(0, chunk.slots)
            attn = F.scaled_dot_product_attention(
                _heads_first(q[chunk.rows]),
                _heads_first(keys),
                _heads_first(values),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[chunk.rows] = attn.squeeze(0).transpose(0, 1)
        return out
