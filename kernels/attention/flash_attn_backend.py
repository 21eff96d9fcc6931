"""flash-attn 2 over the paged cache: `flash_attn_with_kvcache` for an all-decode step (one
query row per request, the case CUDA graphs replay), `flash_attn_varlen_func` with a block
table for any step with prefill chunks (cached prefixes included: flash-attn aligns the causal
mask to the end of each request's keys, which is where its new rows sit).

The cache layout `[num_blocks, block_size, kv_heads, head_dim]` is the one both kernels read;
block_size must be a multiple of 256 (the selector sees to it). New K/V go in with the Triton
store kernel first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from kernels.attention.backend import AttentionMetadata
from kernels.triton.store_kv import store_kv


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 offsets starting at 0, on the device (no sync)."""
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


class FlashAttn2Backend:
    name = "flash-attn"
    graph_safe = True  # the decode path reads only device tensors and `query_lens`

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
        if max(meta.query_lens, default=0) == 1:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seqlens_k,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        if meta.backend_plan is None:  # the same in every layer
            meta.backend_plan = cumulative(meta.seqlens_k)
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.backend_plan,
            max(meta.query_lens),
            max(meta.context_lens),
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
