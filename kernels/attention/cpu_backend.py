"""Paged attention on the CPU through the C++ kernel in kernels/cpu: one call per layer for the
whole step (decode rows and prefill chunks), keys and values read in place through the block
table. New K/V are stored first, as in every backend.
"""

from __future__ import annotations

import torch

from kernels.attention.backend import AttentionMetadata
from kernels.cpu.paged_attention_op import paged_attention
from kernels.kv_store import store_kv


class CpuPagedBackend:
    name = "cpu"
    graph_safe = False  # CPU only: there are no CUDA graphs to capture

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
        q = q.contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seqlens_k, scale)
        return out
