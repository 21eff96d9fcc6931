"""Pure-torch paged attention: gather each request's blocks, then SDPA. The ground truth on CPU.

Decode rows (one query each) of all requests go through one padded, masked SDPA call; each
prefill chunk goes through its own call with a causal mask offset by its cached context, so a
long prompt never pads the decodes beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata
from kernels.kv_store import store_kv


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence's K or V: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:length]


class TorchReferenceBackend:
    name = "torch"

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
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
        starts = meta.cu_seqlens_q.tolist()
        if decode:
            self._decode(q, k_cache, v_cache, meta, scale, decode, starts, out)
        for i, q_len in enumerate(meta.query_lens):
            if q_len > 1:
                self._prefill(q, k_cache, v_cache, meta, scale, i, starts[i], q_len, out)
        return out

    def _prefill(self, q, k_cache, v_cache, meta, scale, i, start, q_len, out) -> None:
        ctx = meta.context_lens[i]
        keys = gather_context(k_cache, meta.block_tables[i], ctx)
        values = gather_context(v_cache, meta.block_tables[i], ctx)
        mask = None
        if ctx != q_len:
            # Query row r sits at position ctx - q_len + r and may see keys up to it.
            rows = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
        out[start : start + q_len] = _sdpa(q[start : start + q_len], keys, values, mask, scale, causal=mask is None)

    def _decode(self, q, k_cache, v_cache, meta, scale, rows, starts, out) -> None:
        lens = [meta.context_lens[i] for i in rows]
        max_len = max(lens)
        block_size = k_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables[rows, :num_blocks].long()
        keys = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, T, kv_heads, dim]
        values = v_cache[tables].flatten(1, 2)[:, :max_len]
        length = torch.tensor(lens, device=q.device).unsqueeze(1)
        mask = (torch.arange(max_len, device=q.device).unsqueeze(0) < length)[:, None, None, :]
        index = torch.tensor([starts[i] for i in rows], device=q.device)
        query = q.index_select(0, index).unsqueeze(2)  # [B, heads, 1, dim]
        attn = F.scaled_dot_product_attention(
            query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )
        out.index_copy_(0, index, attn.squeeze(2))


def _sdpa(q, keys, values, mask, scale, causal: bool) -> torch.Tensor:
    """q: [q_len, heads, dim]; keys/values: [ctx, kv_heads, dim] -> [q_len, heads, dim]."""
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return attn.transpose(0, 1)
