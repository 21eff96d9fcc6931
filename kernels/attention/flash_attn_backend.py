"""flash-attn 2 over the paged cache: `flash_attn_with_kvcache` for an all-decode step (one
query row per request, the case CUDA graphs replay), `flash_attn_varlen_func` with a block
table for any step with prefill chunks (cached prefixes included: flash-attn aligns the causal
mask to the end of each request's keys, which is where its new rows sit).

The cache layout `[num_blocks, block_size, kv_heads, head_dim]` is the one both kernels read;
block_size must be a multiple of 256 (the selector sees to it). New K/V go in with the Triton
store kernel first.

Both calls take a sliding window as `window_size=(left, right)`, a row at position p seeing keys
p - left .. p + right (-1: no bound), so a window of W keys is (W - 1, 0); and a softcap as
`softcap` (0.0: none), applied to the scaled scores as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
from kernels.triton.store_kv import store_kv


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] int32 offsets starting at 0, on the device (no sync)."""
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """flash-attn 2's (left, right) for a window of `sliding_window` keys ending at the row."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        check_window_and_softcap(sliding_window, softcap)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window, cap = window_size(sliding_window), 0.0 if softcap is None else float(softcap)
        if max(meta.query_lens, default=0) == 1:
            out = flash_attn_with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seqlens_k,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=window,
                softcap=cap,
            )
            return out.squeeze(1)
        # The same in every layer, whatever its window.
        cu_seqlens_k = meta.planned("cu_seqlens_k", lambda: cumulative(meta.seqlens_k))
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            cu_seqlens_k,
            max(meta.query_lens),
            max(meta.context_lens),
            softmax_scale=scale,
            causal=True,
            window_size=window,
            softcap=cap,
            block_table=meta.block_tables,
        )
