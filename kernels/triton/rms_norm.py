"""RMSNorm of each row, optionally after adding the residual, in one pass (the decoder layer's
`norm(x)` and `norm(residual + x)`), rounded where the torch ops round: the sum to the
activations' dtype, the normalized row to it before the weight multiplies it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read only with HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    sum_ptr,  # residual + x, written only with HAS_RESIDUAL
    stride_x,
    stride_residual,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # HIDDEN rounded up to a power of two
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * HIDDEN + offs, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    summed: torch.Tensor | None = None,
) -> KernelLaunch:
    """The launch for x [rows, hidden] (rows may be strided), `out` (and `summed`) contiguous;
    also read by the GPU compile test."""
    rows, hidden = x.shape
    assert x.stride(1) == 1 and out.is_contiguous()
    if residual is not None:
        assert summed is not None and residual.stride(1) == 1 and summed.is_contiguous()
    return KernelLaunch(
        kernel=_rms_norm_kernel,
        grid=(rows,),
        args={
            "x_ptr": x,
            "residual_ptr": x if residual is None else residual,
            "weight_ptr": weight,
            "out_ptr": out,
            "sum_ptr": out if summed is None else summed,
            "stride_x": x.stride(0),
            "stride_residual": 0 if residual is None else residual.stride(0),
            "eps": eps,
        },
        constexprs={
            "HIDDEN": hidden,
            "BLOCK": triton.next_power_of_2(hidden),
            "HAS_RESIDUAL": residual is not None,
        },
        options={"num_warps": _warps(hidden)},
    )


def _warps(hidden: int) -> int:
    """Enough threads that each holds a few elements of the row, at most 16 warps."""
    return max(1, min(16, triton.next_power_of_2(hidden) // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, in x's dtype; x's last dim contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        rms_norm_launch(rows, weight, eps, out).run()
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for [tokens, hidden] tensors."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        rms_norm_launch(x, weight, eps, out, residual, summed).run()
    return out, summed
