"""bfloat16 linear layers on CPUs with AVX512-BF16 and no AMX (bf16_linear.cpp, built with
the package; kernels/cpu/extension.py loads it): the weight packed once at load into a layout of its own, which
every step then reads, whatever its row count.

Its sums are float32 in another order than oneDNN's, so its outputs are F.linear's up to the
last bit of the bf16 rounding, not bit for bit."""

from __future__ import annotations

import torch

from kernels.cpu.extension import load

_module = load("bf16_linear")

# The build has the kernel (AVX512-BF16); and whether to take it over oneDNN here (no AMX).
AVAILABLE: bool = _module.available()
PREFERRED: bool = _module.preferred()


def can_pack(weight: torch.Tensor) -> bool:
    return (
        AVAILABLE
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in the kernel's layout, as an [out, in] tensor (like oneDNN's)."""
    return _module.pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight.T + bias, from the packed weight (through the torch operator the
    C++ layer loop calls too)."""
    return torch.ops.pagedserve.bf16_linear(x.contiguous(), packed, bias)
