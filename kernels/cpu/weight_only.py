"""The linear of a weight-only quantized layer: kernels/cpu/quant_linear where it loads, else
the float32 matmul of the de-quantized weight (slow, the same numbers up to the order of the
sums; with int8 activations, kernels/cpu/activation_quant's reference of that arithmetic).
extension.py logs once why the kernel did not load."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kernels.cpu.quant_layout import PackedWeight

Linear = Callable[[torch.Tensor, PackedWeight, torch.Tensor | None, bool], torch.Tensor]


def _reference(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, int8_activations: bool
) -> torch.Tensor:
    from kernels.cpu.activation_quant import reference_int8_linear
    from kernels.cpu.quant_linear_reference import reference_linear

    if int8_activations:
        return reference_int8_linear(x, weight, bias)
    return reference_linear(x, weight, bias)


@functools.cache
def _kernel() -> Linear:
    try:
        from kernels.cpu import quant_linear
    except ImportError:
        return _reference
    return quant_linear.linear


def linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [..., k] @ de-quantized weight.T + bias (float32 [n] or None), in x's dtype;
    `int8_activations`: x rounded to int8 per block of 32 first (weights in groups of 32s)."""
    rows = x.reshape(-1, x.shape[-1])
    out = _kernel()(rows, weight, bias, int8_activations)
    return out.view(*x.shape[:-1], out.shape[-1])
