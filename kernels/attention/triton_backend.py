"""The Triton backend: KV store and paged attention as Triton kernels (kernels/triton).

A sliding window and a softcap are compile-time flags of the attention kernel (the window's
size and the cap are runtime arguments): a windowed layer skips the key tiles before its rows'
windows, and a model's windowed and global layers each run their own specialization. Nothing
is planned per step, so layers share nothing that depends on them.
"""

from __future__ import annotations

import torch

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        check_window_and_softcap(sliding_window, softcap)
        if not kv_stored:
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
            sliding_window=sliding_window,
            softcap=softcap,
        )
