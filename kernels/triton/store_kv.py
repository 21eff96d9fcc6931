"""Write each new token's K and V into the paged cache at its slot (slot -1: padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k,
    stride_v,  # between tokens; within a token, heads x dims are contiguous
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,  # ROW rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, kv_heads, head_dim] (token rows may be strided, as a slice of a fused
    qkv projection is); caches: [num_blocks, block_size, kv_heads, head_dim], contiguous."""
    if k.shape[0] == 0:
        return
    store_kv_launch(k, v, k_cache, v_cache, slot_mapping).run()


def store_kv_launch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> KernelLaunch:
    """The kernel's launch for these tensors (shapes as `store_kv`'s), also read by the GPU
    compile test."""
    num_tokens, heads, dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = heads * dim
    return KernelLaunch(
        kernel=_store_kv_kernel,
        grid=(num_tokens,),
        args={
            "k_ptr": k,
            "v_ptr": v,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "slot_mapping_ptr": slot_mapping,
            "stride_k": k.stride(0),
            "stride_v": v.stride(0),
        },
        constexprs={"ROW": row, "BLOCK": triton.next_power_of_2(row)},
    )
