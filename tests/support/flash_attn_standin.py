"""A stand-in for the flash-attn kernels, which need a CUDA GPU and cannot run here.

It implements, in plain torch on any device, the documented contracts of the three calls the
backends make: flash-attn 2's `flash_attn_varlen_func(..., block_table=)` and
`flash_attn_with_kvcache(..., cache_seqlens=, block_table=)`, and flash-attn 4's
`flash_attn.cute.flash_attn_varlen_func(..., seqused_k=, page_table=)`. Paged caches are
`[num_blocks, page_size, kv_heads, head_dim]`; query head h reads KV head h // (heads /
kv_heads); a causal mask is aligned to the bottom right (query row r of Lq sees keys up to
r + Lk - Lq). The documented argument rules are asserted, so a backend that breaks one fails
here as it would on a GPU. What this cannot show is the kernels' own numerics.

Local attention and softcapping as the libraries document and implement them: `window_size=
(left, right)` lets row r see keys r + Lk - Lq - left .. r + Lk - Lq + right, a bound of -1
(flash-attn 2) or None (flash-attn 4) being no bound, `causal=True` setting right to 0 (both
libraries do so before choosing a mask; flash-attn 4 also drops a pair whose sum is negative);
`softcap` > 0 turns the scaled scores s into softcap * tanh(s / softcap) before the mask, 0.0
turns it off.
"""

from __future__ import annotations

import itertools
import sys
import types

import torch


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seqlen_k: int,
    scale: float,
    left: int | None,
    right: int | None,
    softcap: float,
) -> torch.Tensor:
    """One sequence: q [Lq, heads, dim] against its first `seqlen_k` keys found through `table`;
    row r sees keys r + Lk - Lq - left .. r + Lk - Lq + right (None: unbounded on that side)."""
    page = k_cache.shape[1]
    pos = torch.arange(seqlen_k, device=q.device)
    blocks = table.long()[pos // page]
    keys, values = (
        k_cache[blocks, pos % page].float(),
        v_cache[blocks, pos % page].float(),
    )  # [Lk, kv_heads, dim]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + seqlen_k - q.shape[0]
    if right is not None:
        scores = scores.masked_fill(pos.unsqueeze(0) > rows + right, float("-inf"))
    if left is not None:
        scores = scores.masked_fill(pos.unsqueeze(0) < rows - left, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)


def _fa2_bounds(causal: bool, window_size, softcap) -> tuple[int | None, int | None]:
    """flash-attn 2's window: two ints, negative meaning unbounded; causal sets right to 0."""
    assert isinstance(window_size, tuple) and len(window_size) == 2
    assert all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    assert isinstance(softcap, float) and softcap >= 0.0, "softcap: a float, 0.0 when off"
    left, right = window_size
    if causal:
        right = 0
    return (left if left >= 0 else None), (right if right >= 0 else None)


def _fa4_bounds(causal: bool, window_size, softcap) -> tuple[int | None, int | None]:
    """flash-attn 4's window: ints or None (unbounded); causal sets right to 0, and a pair
    whose sum is negative is dropped (flash_attn/cute/interface.py)."""
    assert isinstance(window_size, tuple) and len(window_size) == 2
    assert all(w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window_size)
    assert isinstance(softcap, float) and softcap >= 0.0, "softcap: a float, 0.0 when off"
    left, right = window_size
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    return left, right


def _check_paged(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, batch: int
) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert table.dtype == torch.int32 and table.shape[0] == batch and table.stride(-1) == 1


def fa2_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    assert block_table is not None and k.shape[1] % 256 == 0, (
        "page_block_size must be a multiple of 256"
    )
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    batch = cu_seqlens_q.shape[0] - 1
    assert cu_seqlens_k.shape == (batch + 1,)
    _check_paged(k, v, block_table, batch)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [b - a for a, b in itertools.pairwise(cu_q)]
    lens_k = [b - a for a, b in itertools.pairwise(cu_k)]
    assert max(lens_q) <= max_seqlen_q and max(lens_k) <= max_seqlen_k
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = _fa2_bounds(causal, window_size, softcap)
    out = torch.empty_like(q)
    for i in range(batch):
        rows = slice(cu_q[i], cu_q[i + 1])
        out[rows] = _attend(q[rows], k, v, block_table[i], lens_k[i], scale, left, right, softcap)
    return out


def fa2_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    assert q.dim() == 4, "q: (batch_size, seqlen, nheads, headdim)"
    assert k is None and v is None  # the backends store K/V themselves
    assert block_table is not None and k_cache.shape[1] % 256 == 0, (
        "page_block_size must be a multiple of 256"
    )
    assert isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
    _check_paged(k_cache, v_cache, block_table, q.shape[0])
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = _fa2_bounds(causal, window_size, softcap)
    out = torch.stack(
        [
            _attend(
                q[i],
                k_cache,
                v_cache,
                block_table[i],
                int(cache_seqlens[i]),
                scale,
                left,
                right,
                softcap,
            )
            for i in range(q.shape[0])
        ]
    )
    return out


def fa4_varlen(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    mask_mod=None,
    block_sparse_tensors=None,
    cu_total_m_blocks=None,
    cu_total_n_blocks=None,
    aux_tensors=None,
    return_lse=False,
):
    assert page_table is not None and cu_seqlens_k is None, (
        "page_table is not supported with cu_seqlens_k"
    )
    batch = cu_seqlens_q.shape[0] - 1
    for t in (cu_seqlens_q, seqused_k):
        assert t.dtype == torch.int32 and t.stride(0) == 1 and t.shape[0] in (batch, batch + 1)
    _check_paged(k, v, page_table, batch)
    cu_q = cu_seqlens_q.tolist()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = _fa4_bounds(causal, window_size, softcap)
    out = torch.empty_like(q)
    for i in range(batch):
        rows = slice(cu_q[i], cu_q[i + 1])
        out[rows] = _attend(
            q[rows], k, v, page_table[i], int(seqused_k[i]), scale, left, right, softcap
        )
    return out, None


def install(monkeypatch) -> None:
    """Put the stand-in where `import flash_attn` and `import flash_attn.cute` find it."""
    fa2 = types.ModuleType("flash_attn")
    fa2.flash_attn_varlen_func, fa2.flash_attn_with_kvcache = fa2_varlen, fa2_with_kvcache
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fa4_varlen
    fa2.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", fa2)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    for backend in (
        "kernels.attention.flash_attn_backend",
        "kernels.attention.flash_attn4_backend",
    ):
        monkeypatch.delitem(
            sys.modules, backend, raising=False
        )  # imported afresh, against the stand-in
