"""flash-attn 4 (`flash_attn.cute`, Hopper and Blackwell) over the paged cache: one varlen
call per step whatever its mix, keys found through `page_table` with each request's key count
in `seqused_k` (a page table cannot be combined with `cu_seqlens_k`). Causal masks align to the
end of each request's keys, where its new rows sit. New K/V go in with the Triton store kernel.

A sliding window goes in as `window_size=(left, right)`, a row at position p seeing keys
p - left .. p + right (None: no bound; `causal` sets right to 0), so a window of W keys is
(W - 1, 0); a softcap as `softcap` (0.0: none), applied to the scaled scores.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_varlen_func

from kernels.attention.backend import AttentionMetadata, check_window_and_softcap
from kernels.triton.store_kv import store_kv


class FlashAttn4Backend:
    name = "flash-attn-4"
    graph_safe = (
        False  # capturing its JIT-compiled kernels in a CUDA graph has not been verified here
    )

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
        result = flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            max_seqlen_q=max(meta.query_lens),
            max_seqlen_k=max(meta.context_lens),
            seqused_k=meta.seqlens_k,
            page_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=(None, None) if sliding_window is None else (sliding_window - 1, 0),
            softcap=0.0 if softcap is None else float(softcap),
        )
        # Releases differ: some return (out, lse), some out alone.
        return result[0] if isinstance(result, tuple) else result
