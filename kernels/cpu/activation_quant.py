"""Activations rounded to int8 per block of 32 inputs (llama.cpp's Q8_0 applied to a row), as
kernels/cpu/quant_linear multiplies them with 4-bit and 8-bit weights under
--quantize-activations int8;
and the float32 linear of that arithmetic in torch, the fallback where the kernel does not load.

A block's scale is d = max |x| / 127 in float32, its values round(x / d), to nearest with ties to
even (torch.round; the kernel's default rounding mode), so the largest magnitude maps to +-127;
a block of zeros has d = 0 and values 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.quant_layout import PackedWeight, unpack

BLOCK = 32  # inputs of one activation scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [rows, k] and float32 scales [rows, k / BLOCK] of x [rows, k]."""
    rows, k = x.shape
    blocks = x.to(torch.float32).view(rows, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127)
    values = torch.where(scales.unsqueeze(-1) > 0, values, torch.zeros_like(values))
    return values.to(torch.int8).view(rows, k), scales


def reference_int8_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's formula in float32 torch ops: sum over groups of scale x (q . a d) plus
    min x the group's sum of the rounded inputs a d (the order of the sums differs)."""
    unpacked = unpack(weight)
    rows, k = x.shape
    values, scales = quantize_activations(x)
    rounded = (values.to(torch.float32).view(rows, -1, BLOCK) * scales.unsqueeze(-1)).view(rows, k)
    groups = unpacked.scales.shape[1]
    w = unpacked.q.to(torch.float32).view(-1, groups, k // groups) * unpacked.scales.unsqueeze(-1)
    out = F.linear(rounded, w.view(-1, k), bias)
    if unpacked.mins is not None:  # the min meets the rounded inputs too
        sums = rounded.view(rows, groups, k // groups).sum(dim=-1)
        out = out + F.linear(sums, unpacked.mins)
    return out.to(x.dtype)
