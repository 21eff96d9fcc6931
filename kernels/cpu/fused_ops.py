"""A decoder layer's elementwise work on the CPU as single passes (fused_ops.cpp, built with
the package; kernels/cpu/extension.py loads it): RMSNorm, residual add + RMSNorm, SiLU(gate) * up, rotary in
place. On a 2,048-token prefill step of the default model in bf16 the eager torch ops these
replace took about half the step (the linear layers a third).

Each returns what the eager torch ops give, rounded at the same points; the float32 sums inside
an RMSNorm are added in another order, so float32 results may differ in the last bit.
Built with -ffp-contract=off (kernels/cpu/targets.py) so that `a * b + c` is not fused into one
rounding where torch rounds twice.
"""

from __future__ import annotations

import torch

from kernels.cpu.extension import load

_module = load("fused_ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim; x's last dim must be contiguous."""
    return _module.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for contiguous [tokens, hidden] tensors."""
    normed, summed = _module.add_rms_norm(x, residual, weight, eps)
    return normed, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up [tokens, 2 * width] contiguous with the gate columns first."""
    return _module.silu_mul(gate_up)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [tokens, heads, dim] (any token stride, heads packed) rotated in place, rotate-half
    layout; cos and sin [tokens, dim] contiguous."""
    _module.rotary_(x, cos, sin)
