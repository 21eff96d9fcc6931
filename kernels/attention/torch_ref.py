"""Pure-torch paged attention: gather each request's context through its block table, then SDPA.
The ground truth on CPU.

Decode rows (one query each) of all requests go through one padded, masked SDPA call; each
prefill chunk goes through its own call with a causal mask offset by its cached context, so a
long prompt never pads the decodes beside it. Which cache slots to read, and the masks, are
the same in every layer: they are planned once per step and kept on the metadata.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata
from kernels.kv_store import store_kv


@dataclass
class _Prefill:
    start: int  # first query row
    q_len: int
    slots: torch.Tensor  # [ctx] flat cache slots of the context, in order
    mask: torch.Tensor | None  # [q_len, ctx] when the chunk has cached context before it


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None  # [B] query rows of the decode requests
    decode_slots: torch.Tensor | None  # [B, T] flat cache slots (padding reads slot 0, masked)
    decode_mask: torch.Tensor | None  # [B, 1, 1, T]
    prefills: list[_Prefill]


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of a sequence's first `length` tokens."""
    pos = torch.arange(length, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def visible_keys(q_len: int, ctx: int, device: torch.device) -> torch.Tensor:
    """[q_len, ctx] bool: the keys each row of a chunk after cached context sees (row r sits at
    position ctx - q_len + r and sees the keys up to it)."""
    rows = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    return torch.arange(ctx, device=device).unsqueeze(0) <= rows


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
    starts = [0, *itertools.accumulate(meta.query_lens)]  # host lists: no device sync
    decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
    decode_rows = decode_slots = decode_mask = None
    if decode:
        lens = torch.tensor([meta.context_lens[i] for i in decode], device=device)
        max_len = int(lens.max())
        pos = torch.arange(max_len, device=device)
        valid = pos.unsqueeze(0) < lens.unsqueeze(1)
        tables = meta.block_tables[decode].long()
        slots = tables.gather(
            1, (pos // block_size).clamp(max=tables.shape[1] - 1).expand(len(decode), -1)
        )
        decode_slots = torch.where(valid, slots * block_size + pos % block_size, 0)
        decode_mask = valid[:, None, None, :]
        decode_rows = torch.tensor([starts[i] for i in decode], device=device)
    prefills = []
    for i, q_len in enumerate(meta.query_lens):
        if q_len > 1:
            ctx = meta.context_lens[i]
            mask = None
            if ctx != q_len:
                mask = visible_keys(q_len, ctx, device)
            prefills.append(
                _Prefill(
                    starts[i], q_len, context_slots(meta.block_tables[i], ctx, block_size), mask
                )
            )
    return _Plan(decode_rows, decode_slots, decode_mask, prefills)


class TorchReferenceBackend:
    name = "torch"
    graph_safe = False  # plans each step from host context lengths

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_blocks, block_size, kv_heads, dim = k_cache.shape
        if meta.backend_plan is None:
            meta.backend_plan = _plan(meta, block_size, q.device)
        plan: _Plan = meta.backend_plan
        k_flat = k_cache.view(num_blocks * block_size, kv_heads, dim)
        v_flat = v_cache.view(num_blocks * block_size, kv_heads, dim)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            assert plan.decode_slots is not None  # planned together with decode_rows
            batch, length = plan.decode_slots.shape
            flat = plan.decode_slots.flatten()
            keys = k_flat.index_select(0, flat).view(batch, length, kv_heads, dim).transpose(1, 2)
            values = v_flat.index_select(0, flat).view(batch, length, kv_heads, dim).transpose(1, 2)
            query = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, heads, 1, dim]
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
            )
            out.index_copy_(0, plan.decode_rows, attn.squeeze(2))
        for p in plan.prefills:
            rows = slice(p.start, p.start + p.q_len)
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                k_flat.index_select(0, p.slots).transpose(0, 1),
                v_flat.index_select(0, p.slots).transpose(0, 1),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = attn.transpose(0, 1)
        return out
