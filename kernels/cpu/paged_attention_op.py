"""The CPU paged-attention kernel (paged_attention.cpp), built with the package and loaded by
kernels/cpu/extension.py."""

from __future__ import annotations

import torch

from kernels.cpu.extension import load

_module = load("paged_attention")

# Whether bfloat16 decode rows (head dims 64 and 128, no sliding window, blocks of a multiple of
# 16 tokens) are multiplied on AMX tiles; elsewhere they take the vector path.
DECODES_ON_TILES: bool = _module.decodes_on_tiles()


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    max_query_len: int = 2**31 - 1,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Writes into `out` [tokens, heads, dim] the causal attention of every query row of `q`
    over its request's cached keys (all contiguous; tables and lengths int32), each row seeing
    only the last `sliding_window` keys up to its own and its scores capped by `softcap` when
    given (kernels/attention/backend.py). The rows of requests with more than `max_query_len`
    query rows are not written."""
    _module.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        scale,
        max_query_len,
        sliding_window or 0,  # the kernel's "none"
        softcap or 0.0,
    )
