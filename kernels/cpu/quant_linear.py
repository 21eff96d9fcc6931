"""Weight-only quantized linear layers on the CPU (quant_linear.cpp, built with the package;
kernels/cpu/extension.py loads it): x [rows, k] bf16 or float32 against a PackedWeight
(kernels/cpu/quant_layout, 8-bit or 4-bit), float32 sums, the result in x's dtype. The
AVX512-BF16 code where the CPU has it, else a portable loop; kernels/cpu/weight_only falls back
to torch where the module does not load at all.

`int8_activations` (4-bit or 8-bit weights in groups of a multiple of 32): each row's inputs
rounded to int8 per block of 32 (kernels/cpu/activation_quant.py) and multiplied as integers,
with AVX512-VNNI where the CPU has it (VNNI), else the same arithmetic in the portable loop."""

from __future__ import annotations

import torch

from kernels.cpu.extension import load
from kernels.cpu.quant_layout import PackedWeight

_module = load("quant_linear")

# Whether this CPU takes the vector code (AVX512-BF16) rather than the portable loop.
VECTOR: bool = _module.vector_path()
# Whether it takes the int8-activation vector code (AVX512-VNNI, VBMI and BF16) rather than the loop.
VNNI: bool = _module.vnni_path()
# From how many bf16 rows (0: never) the vector code de-quantizes the whole weight into bf16 and
# lets torch multiply it (oneDNN on AMX tiles): a build for a CPU with AMX. Those rows then get
# the de-quantized weights' product, also with int8 activations (which are not rounded there).
TILE_ROWS: int = _module.tile_rows()


def linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [rows, k] @ de-quantized weight.T + bias (bias float32 [n] or None)."""
    return torch.ops.pagedserve.quant_linear(
        x.contiguous(), weight.q, weight.scales, weight.mins, bias, int8_activations
    )


def linear_portable(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """The same through the portable loop whatever this CPU has (to check it where it is not
    the one that runs)."""
    return _module.linear_portable(
        x.contiguous(), weight.q, weight.scales, weight.mins, bias, int8_activations
    )


def quantize_activations(
    x: torch.Tensor, portable: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 values [rows, k] and float32 scales [rows, k / 32] as the kernel rounds them
    (`portable`: as the portable loop does, whatever this CPU has)."""
    values, scales = _module.quantize_activations(x.contiguous(), not portable)
    return values, scales
