"""Quantized weights with float32 scales (and mins) per output row and group of input dims, and
the layout the quantized linear kernel reads (kernels/cpu/quant_linear.cpp). Plain torch:
quantizing, packing and de-quantizing need no compiled kernel, so loading and the checks run
everywhere.

A weight [n, k] is `q` [n, k] (int8 storage of its integers), `scales` float32 [n, k / group]
and, for some formats, `mins` of that shape; its value is q * scale (+ min), in float32. 8-bit:
q in -128..127 (our per-channel int8 uses -127..127; GGUF's Q8_0 with groups of 32, GPTQ and
compressed-tensors int8 may hold -128). 4-bit: q in 0..15, groups
of 32 (GGUF's Q4_1 with its min, Q4_0 with min = -8 * scale)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_COLUMNS = 16  # output columns of one vector in the packed layout
ITEM_COLUMNS = 32  # columns are padded to a multiple of this (two vectors a work item)


@dataclass(frozen=True)
class QuantizedWeight:
    q: torch.Tensor  # int8 [n, k]
    scales: torch.Tensor  # float32 [n, k / group]
    mins: torch.Tensor | None = None  # float32 [n, k / group]
    bits: int = 8

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.int8 or self.scales.dtype != torch.float32:
            raise ValueError("a quantized weight is int8-stored values and float32 scales")
        groups = self.scales.shape[1] if self.scales.dim() == 2 else 0
        if self.scales.shape[0] != n or groups == 0 or k % groups or (k // groups) % 2:
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not split a [{n}, {k}] weight into"
                " groups of an even size"
            )
        if self.mins is not None and (
            self.mins.shape != self.scales.shape or self.mins.dtype != torch.float32
        ):
            raise ValueError("mins are float32 and shaped as the scales")
        if self.bits not in (8, 4):
            raise ValueError(f"{self.bits}-bit weights: 8 or 4")

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these stand for (q * scale + min), the kernel's reference."""
        n, k = self.q.shape
        groups = self.scales.shape[1]
        values = self.q.to(torch.float32).view(n, groups, k // groups)
        # In place, the same float32 operations: a new tensor per step would hold two or three
        # of the result's size at once (a de-quantized embedding at load is 100+ MB).
        values.mul_(self.scales.unsqueeze(-1))
        if self.mins is not None:
            values.add_(self.mins.unsqueeze(-1))
        return values.view(n, k)


def quantize(weight: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """int8, symmetric round-to-nearest: each group's largest magnitude maps to 127 (group None:
    the whole row, per-channel). Computed in float32 from whatever the checkpoint holds."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    group = k if group is None else group
    if k % group or group % 2:
        raise ValueError(f"int8: {k} input features do not split into groups of {group}")
    grouped = w.view(n, k // group, group)
    scales = grouped.abs().amax(dim=-1) / 127.0
    # An all-zero group: any scale reproduces it; 1 avoids dividing by zero.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k), scales.contiguous())


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernel's layout: `q` [n, k] int8 (8-bit) or [n, k / 2] uint8
    (4-bit) over blocks [padded n / 16, k / 2, step bytes]; `scales` and `mins` [n, groups]
    float32 over blocks [padded n / 16, groups, 16]; padded columns zero. As with
    bf16_linear's packed weight, the views' sizes say the layer's shape; their storage is the
    blocks."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == torch.uint8 else 8

    @property
    def n(self) -> int:
        return int(self.q.shape[0])

    @property
    def k(self) -> int:
        return int(self.q.shape[1]) * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.untyped_storage().nbytes()
        return self.q.untyped_storage().nbytes() + self.scales.untyped_storage().nbytes() + mins


def _padded(n: int) -> int:
    return (n + ITEM_COLUMNS - 1) // ITEM_COLUMNS * ITEM_COLUMNS


def _pack_groups(values: torch.Tensor, padded: int) -> torch.Tensor:
    n, groups = values.shape
    blocks = F.pad(values, (0, 0, 0, padded - n)).view(padded // STEP_COLUMNS, STEP_COLUMNS, groups)
    return blocks.permute(0, 2, 1).contiguous().view(-1).as_strided((n, groups), (groups, 1))


def pack(weight: QuantizedWeight) -> PackedWeight:
    n, k = weight.q.shape
    padded = _padded(n)
    q = F.pad(weight.q, (0, 0, 0, padded - n))
    # Steps of 16 columns x 2 inputs: [block, pair, 32 values].
    steps = q.view(padded // STEP_COLUMNS, STEP_COLUMNS, k // 2, 2).permute(0, 2, 1, 3)
    steps = steps.reshape(padded // STEP_COLUMNS, k // 2, 2 * STEP_COLUMNS)
    if weight.bits == 4:  # byte j: value j in its low nibble, value j + 16 in its high one
        nibbles = steps.to(torch.uint8)
        steps = nibbles[..., :16] | (nibbles[..., 16:] << 4)
        row_bytes = k // 2
    else:
        row_bytes = k
    packed_q = steps.contiguous().view(-1).as_strided((n, row_bytes), (row_bytes, 1))
    mins = None if weight.mins is None else _pack_groups(weight.mins, padded)
    return PackedWeight(packed_q, _pack_groups(weight.scales, padded), mins)


def _unpack_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    groups = values.shape[1]
    padded = _padded(n)
    blocks = torch.empty(0, dtype=torch.float32).set_(values.untyped_storage())
    blocks = blocks.view(padded // STEP_COLUMNS, groups, STEP_COLUMNS).permute(0, 2, 1)
    return blocks.reshape(padded, groups)[:n].contiguous()


def unpack(packed: PackedWeight) -> QuantizedWeight:
    """The inverse of `pack` (for the torch fallback where the kernel does not load)."""
    n, k = packed.n, packed.k
    padded = _padded(n)
    storage = torch.empty(0, dtype=packed.q.dtype).set_(packed.q.untyped_storage())
    if packed.bits == 4:
        half = storage.view(padded // STEP_COLUMNS, k // 2, 16)
        steps = torch.cat([half & 0x0F, half >> 4], dim=-1).to(torch.int8)
    else:
        steps = storage.view(padded // STEP_COLUMNS, k // 2, 2 * STEP_COLUMNS)
    q = steps.view(padded // STEP_COLUMNS, k // 2, STEP_COLUMNS, 2).permute(0, 2, 1, 3)
    mins = None if packed.mins is None else _unpack_groups(packed.mins, n)
    return QuantizedWeight(
        q.reshape(padded, k)[:n].contiguous(),
        _unpack_groups(packed.scales, n),
        mins,
        packed.bits,
    )
