"""The CPU prefill-attention kernel for long bfloat16 chunks (prefill_attention.cpp), built
with the package and loaded by kernels/cpu/extension.py."""

from __future__ import annotations

import torch

from kernels.cpu.extension import load

_module = load("prefill_attention")

# Whether the build has the kernel and torch's bfloat16 micro-kernel runs on this CPU (AMX or
# AVX512-BF16); without it callers take SDPA.
AVAILABLE: bool = _module.available()


def takes_head_dim(dim: int) -> bool:
    return bool(_module.takes_head_dim(dim))


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    min_query_len: int,
    sliding_window: int | None = None,
) -> None:
    """Writes into `out` [tokens, heads, dim] the causal attention of the query rows of every
    request with more than `min_query_len` of them, over its cached keys read through the block
    table (bfloat16; tables and lengths int32), each row seeing only the last `sliding_window`
    keys up to its own when given. The other rows of `out` are not written."""
    _module.prefill_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seqlens_k,
        scale,
        min_query_len,
        sliding_window or 0,  # the kernel's "none"
    )
