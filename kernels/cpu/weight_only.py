"""The linear of a weight-only quantized layer: kernels/cpu/int8_linear where it loads, else
the float32 matmul of the de-quantized weight (slow, the same numbers up to the order of the
sums). extension.py logs once why the kernel did not load."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kernels.cpu.int8_layout import PackedInt8

Linear = Callable[[torch.Tensor, PackedInt8, torch.Tensor | None], torch.Tensor]


@functools.cache
def _int8_linear() -> Linear:
    try:
        from kernels.cpu import int8_linear
    except ImportError:
        from kernels.cpu.int8_linear_reference import reference_linear

        return reference_linear
    return int8_linear.linear


def int8_linear_available() -> bool:
    """Whether the compiled kernel runs here (else the torch fallback does)."""
    try:
        from kernels.cpu import int8_linear  # noqa: F401
    except ImportError:
        return False
    return True


def linear(x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] @ de-quantized weight.T + bias (float32 [n] or None), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    out = _int8_linear()(rows, weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])
