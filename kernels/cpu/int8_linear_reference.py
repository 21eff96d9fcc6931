"""The float32 matmul of a PackedInt8 weight, de-quantized: what kernels/cpu/int8_linear
computes up to the order of its sums, and the fallback where that kernel does not load."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.int8_layout import PackedInt8, unpack


def reference_linear(
    x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None
) -> torch.Tensor:
    w = unpack(weight).dequantize()
    return F.linear(x.to(torch.float32), w, bias).to(x.dtype)
