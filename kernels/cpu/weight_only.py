"""The linear of a weight-only quantized layer: kernels/cpu/quant_linear where it loads, else
the float32 matmul of the de-quantized weight (slow, the same numbers up to the order of the
sums). extension.py logs once why the kernel did not load."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kernels.cpu.quant_layout import PackedWeight

Linear = Callable[[torch.Tensor, PackedWeight, torch.Tensor | None], torch.Tensor]


@functools.cache
def _kernel() -> Linear:
    try:
        from kernels.cpu import quant_linear
    except ImportError:
        from kernels.cpu.quant_linear_reference import reference_linear

        return reference_linear
    return quant_linear.linear


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] @ de-quantized weight.T + bias (float32 [n] or None), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = _kernel()(rows, weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])
