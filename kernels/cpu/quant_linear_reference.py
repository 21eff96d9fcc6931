"""The float32 matmul of a PackedWeight, de-quantized: what kernels/cpu/quant_linear computes
up to the order of its sums, and the fallback where that kernel does not load."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.quant_layout import PackedWeight, unpack


def reference_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    w = unpack(weight).dequantize()
    return F.linear(x.to(torch.float32), w, bias).to(x.dtype)
