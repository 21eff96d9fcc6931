"""Pure-torch paged attention: gather each request's context through its block table, then SDPA.
The ground truth on CPU.

Decode rows (one query each) of all requests go through one padded, masked SDPA call; each
prefill chunk goes through its own call with a causal mask offset by its cached context, so a
long prompt never pads the decodes beside it. Which cache slots to read, and the masks, are
the same in every layer of one sliding window: they are planned once per step and window and
kept on the metadata.

A sliding window is one more condition in those masks (a fresh prompt then takes an explicit
mask, not `is_causal`). SDPA cannot cap scores, so a layer with a softcap computes the scores
itself, in float32: product, cap, mask, softmax, product. Without either option the SDPA calls
are the plain ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
from kernels.kv_store import store_kv


@dataclass
class _Prefill:
    start: int  # first query row
    q_len: int
    slots: torch.Tensor  # [ctx] flat cache slots of the context, in order
    # [q_len, ctx] bool, True where a row sees a key: when the chunk has cached context before
    # it or a sliding window hides some of its keys; None: plain causal attention.
    mask: torch.Tensor | None


@dataclass
class _Plan:
    decode_rows: torch.Tensor | None  # [B] query rows of the decode requests
    decode_slots: torch.Tensor | None  # [B, T] flat cache slots (padding reads slot 0, masked)
    decode_mask: torch.Tensor | None  # [B, 1, 1, T]
    prefills: list[_Prefill]


def context_slots(
    block_table: torch.Tensor, length: int, block_size: int, first: int = 0
) -> torch.Tensor:
    """Flat cache slots of a sequence's tokens at positions `first` .. `length` - 1."""
    pos = torch.arange(first, length, device=block_table.device)
    return block_table.long()[pos // block_size] * block_size + pos % block_size


def visible_keys(
    q_len: int,
    ctx: int,
    device: torch.device,
    window: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """[q_len, ctx - first_key] bool: the keys (from position `first_key` on) each row of a chunk
    after cached context sees. Row r sits at position p = ctx - q_len + r and sees the keys up to
    p, and with a window only those after p - window."""
    rows = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    keys = torch.arange(first_key, ctx, device=device).unsqueeze(0)
    visible = keys <= rows
    if window is not None:
        visible &= keys > rows - window
    return visible


def _plan(
    meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None
) -> _Plan:
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
        if window is not None:  # the row sits at position len - 1
            valid &= pos.unsqueeze(0) >= (lens - window).unsqueeze(1)
        decode_mask = valid[:, None, None, :]
        decode_rows = torch.tensor([starts[i] for i in decode], device=device)
    prefills = []
    for i, q_len in enumerate(meta.query_lens):
        if q_len > 1:
            ctx = meta.context_lens[i]
            mask = None
            if ctx != q_len or (window is not None and window < ctx):
                mask = visible_keys(q_len, ctx, device, window)
            prefills.append(
                _Prefill(
                    starts[i], q_len, context_slots(meta.block_tables[i], ctx, block_size), mask
                )
            )
    return _Plan(decode_rows, decode_slots, decode_mask, prefills)


def attention_with_softcap(
    query: torch.Tensor,  # [..., heads, q_len, dim]
    keys: torch.Tensor,  # [..., kv_heads, k_len, dim]
    values: torch.Tensor,
    visible: torch.Tensor,  # bool, broadcasts to [..., heads, q_len, k_len]
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [..., heads, q_len, dim]
    """SDPA's result with the scaled scores capped to `softcap * tanh(s / softcap)` before the
    mask, worked out step by step in float32 (SDPA has no score hook)."""
    group = query.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(group, dim=-3).float()
    values = values.repeat_interleave(group, dim=-3).float()
    scores = query.float() @ keys.transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ values).to(query.dtype)


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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        check_window_and_softcap(sliding_window, softcap)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_blocks, block_size, kv_heads, dim = k_cache.shape
        plan = meta.planned(
            ("torch", sliding_window), lambda: _plan(meta, block_size, q.device, sliding_window)
        )
        k_flat = k_cache.view(num_blocks * block_size, kv_heads, dim)
        v_flat = v_cache.view(num_blocks * block_size, kv_heads, dim)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            assert (
                plan.decode_slots is not None and plan.decode_mask is not None
            )  # planned together
            batch, length = plan.decode_slots.shape
            flat = plan.decode_slots.flatten()
            keys = k_flat.index_select(0, flat).view(batch, length, kv_heads, dim).transpose(1, 2)
            values = v_flat.index_select(0, flat).view(batch, length, kv_heads, dim).transpose(1, 2)
            query = q.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, heads, 1, dim]
            if softcap is None:
                attn = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True
                )
            else:
                attn = attention_with_softcap(query, keys, values, plan.decode_mask, scale, softcap)
            out.index_copy_(0, plan.decode_rows, attn.squeeze(2))
        for p in plan.prefills:
            rows = slice(p.start, p.start + p.q_len)
            query = q[rows].transpose(0, 1)
            keys = k_flat.index_select(0, p.slots).transpose(0, 1)
            values = v_flat.index_select(0, p.slots).transpose(0, 1)
            if softcap is None:
                attn = F.scaled_dot_product_attention(
                    query,
                    keys,
                    values,
                    attn_mask=p.mask,
                    is_causal=p.mask is None,
                    scale=scale,
                    enable_gqa=True,
                )
            else:
                mask = p.mask if p.mask is not None else visible_keys(p.q_len, p.q_len, q.device)
                attn = attention_with_softcap(query, keys, values, mask, scale, softcap)
            out[rows] = attn.transpose(0, 1)
        return out
