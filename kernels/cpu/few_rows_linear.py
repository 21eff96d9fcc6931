"""bfloat16 linear layers of at most 16 rows (a decode step's) on CPUs with AVX512-BF16
(few_rows_linear.cpp, compiled when this module is first imported): the weight in a layout of
its own, packed once at load beside oneDNN's (which longer steps keep using).

Its sums are float32 in another order than oneDNN's, so its outputs are F.linear's up to the
last bit of the bf16 rounding, not bit for bit."""

from __future__ import annotations

import torch

from kernels.cpu.extension import build

_module = build("few_rows_linear.cpp", "pagedserve_cpu_few_rows_linear")

MAX_ROWS: int = _module.MAX_ROWS
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
    """The weight [out, in] in the kernel's layout (out padded to a multiple of 32)."""
    return _module.pack(weight.detach())


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [rows <= MAX_ROWS, in] @ weight.T + bias, from the packed weight."""
    return _module.linear(x.contiguous(), packed, bias, out_features)
