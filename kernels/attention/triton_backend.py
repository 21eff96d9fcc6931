"""The Triton backend: KV store and paged attention as Triton kernels (kernels/triton)."""

from __future__ import annotations

import torch

from kernels.attention.backend import AttentionMetadata
from kernels.triton.paged_attention import paged_attention
from kernels.triton.store_kv import store_kv


class TritonBackend:
    name = "triton"
    graph_safe = True  # the grid depends only on the batch shape; lengths are read on the device

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
        max_query_len = max(meta.query_lens, default=0)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seqlens_k,
            max_query_len,
            scale,
        )
