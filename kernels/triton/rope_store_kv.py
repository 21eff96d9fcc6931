"""The attention layer's work between the qkv projection and attention, in one kernel: the
per-head q/k RMSNorm where the model has one (Qwen3), rotary embedding of q and k
(rotate-half layout, over the whole head), and the store of k and v into the paged cache at each
token's slot (slot -1: padding, whose K/V are not stored). Rotated q goes to a new tensor.

Rounded where the torch ops round (layers/norm.py, layers/rotary.py): the normalized head to
the activations' dtype before and after its weight, each product with cos or sin, then their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x as the torch op in `dtype` would leave it, back in float32 for the next step."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rotate(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One head's (first half, second half) normalized and rotated, in float32."""
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.math.rsqrt(
            (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps
        )
        w1 = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * inv_rms, DTYPE), DTYPE)
        x2 = _round(w2 * _round(x2 * inv_rms, DTYPE), DTYPE)
    cos1 = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1)
    out1 = _round(_round(x1 * cos1, DTYPE) - _round(x2 * sin1, DTYPE), DTYPE)
    out2 = _round(_round(x2 * cos2, DTYPE) + _round(x1 * sin2, DTYPE), DTYPE)
    return out1, out2


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    q_weight_ptr,  # the q/k norms' weights, read only with HAS_NORM
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_q,
    stride_k,
    stride_v,  # between tokens; within a token, heads x dims are contiguous
    stride_rope,  # between cos (and sin) rows
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,  # HEAD_DIM // 2 rounded up to a power of two
    HAS_NORM: tl.constexpr,
):
    # One program per (token, head): q heads first, then kv heads (k rotated, k and v stored).
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    cos_row = cos_ptr + token * stride_rope
    sin_row = sin_ptr + token * stride_rope
    dtype = q_out_ptr.dtype.element_ty
    if head < NUM_HEADS:
        out1, out2 = _norm_rotate(
            q_ptr + token * stride_q + head * HEAD_DIM,
            q_weight_ptr,
            cos_row,
            sin_row,
            eps,
            HEAD_DIM,
            HALF_BLOCK,
            HAS_NORM,
            dtype,
        )
        dst = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(dst + offs, out1.to(dtype), mask=mask)
        tl.store(dst + half + offs, out2.to(dtype), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            out1, out2 = _norm_rotate(
                k_ptr + token * stride_k + kv_head * HEAD_DIM,
                k_weight_ptr,
                cos_row,
                sin_row,
                eps,
                HEAD_DIM,
                HALF_BLOCK,
                HAS_NORM,
                dtype,
            )
            cache_offset = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
            cache_type = k_cache_ptr.dtype.element_ty
            # Through the activations' dtype first, as the torch path stores rotated k.
            tl.store(k_cache_ptr + cache_offset + offs, out1.to(dtype).to(cache_type), mask=mask)
            tl.store(
                k_cache_ptr + cache_offset + half + offs,
                out2.to(dtype).to(cache_type),
                mask=mask,
            )
            full = tl.arange(0, 2 * HALF_BLOCK)
            full_mask = full < HEAD_DIM
            v = tl.load(v_ptr + token * stride_v + kv_head * HEAD_DIM + full, mask=full_mask)
            tl.store(
                v_cache_ptr + cache_offset + full,
                v.to(v_cache_ptr.dtype.element_ty),
                mask=full_mask,
            )


def rope_store_kv_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> KernelLaunch:
    """The launch for these tensors (shapes as `rope_store_kv`'s); also read by the GPU compile
    test."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == dim, "heads x dims must be contiguous"
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    assert cos.shape[1] == dim, "the rotary tables cover the whole head"
    assert q_out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert dim % 2 == 0
    q_weight, k_weight = norm_weights if norm_weights is not None else (q, k)
    half_block = triton.next_power_of_2(dim // 2)
    return KernelLaunch(
        kernel=_rope_store_kv_kernel,
        grid=(tokens, heads + kv_heads),
        args={
            "q_ptr": q,
            "k_ptr": k,
            "v_ptr": v,
            "q_out_ptr": q_out,
            "q_weight_ptr": q_weight,
            "k_weight_ptr": k_weight,
            "cos_ptr": cos,
            "sin_ptr": sin,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "slot_mapping_ptr": slot_mapping,
            "stride_q": q.stride(0),
            "stride_k": k.stride(0),
            "stride_v": v.stride(0),
            "stride_rope": cos.stride(0),
            "eps": eps,
        },
        constexprs={
            "NUM_HEADS": heads,
            "NUM_KV_HEADS": kv_heads,
            "HEAD_DIM": dim,
            "HALF_BLOCK": half_block,
            "HAS_NORM": norm_weights is not None,
        },
        # A program holds one head: a warp per 64 pairs, not the default 4 mostly idle ones.
        options={"num_warps": max(1, half_block // 64)},
    )


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """q [tokens, heads, dim] normalized (with `norm_weights`: q's and k's RMSNorm weights, each
    [dim]) and rotated, returned as a new contiguous tensor; k [tokens, kv_heads, dim] normalized
    and rotated, and v, stored into the caches [num_blocks, block_size, kv_heads, dim] at
    `slot_mapping` (slots < 0 skipped). q, k, v may be strided token rows (slices of the fused
    qkv projection); cos and sin are [tokens, dim] in q's dtype."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        rope_store_kv_launch(
            q, k, v, q_out, cos, sin, k_cache, v_cache, slot_mapping, norm_weights, eps
        ).run()
    return q_out
