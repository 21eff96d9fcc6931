"""int8 weights with float32 scales per output row and group of input dims, and the layout the
int8 linear kernel reads (kernels/cpu/int8_linear.cpp). Plain torch: quantizing, packing and
de-quantizing need no compiled kernel, so loading and the checks run everywhere.

A weight [n, k] is `q` int8 [n, k] and `scales` float32 [n, k / group]; its value is
q * scale, in float32. Per-channel is one group of the whole row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_COLUMNS = 16  # output columns of one vector in the packed layout
ITEM_COLUMNS = 32  # columns are padded to a multiple of this (two vectors a work item)


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # int8 [n, k]
    scales: torch.Tensor  # float32 [n, k / group]

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.int8 or self.scales.dtype != torch.float32:
            raise ValueError("an int8 weight is int8 values and float32 scales")
        groups = self.scales.shape[1] if self.scales.dim() == 2 else 0
        if self.scales.shape[0] != n or groups == 0 or k % groups or (k // groups) % 2:
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not split a [{n}, {k}] weight into"
                " groups of an even size"
            )

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these stand for (q * scale), the reference the kernel is held to."""
        n, k = self.q.shape
        groups = self.scales.shape[1]
        values = self.q.to(torch.float32).view(n, groups, k // groups)
        return (values * self.scales.unsqueeze(-1)).view(n, k)


def quantize(weight: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric round-to-nearest: each group's largest magnitude maps to 127 (group None: the
    whole row, per-channel). Computed in float32 from whatever the checkpoint holds."""
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
    return Int8Weight(q.view(n, k), scales.contiguous())


@dataclass(frozen=True)
class PackedInt8:
    """An Int8Weight in the kernel's layout: `q` [n, k] int8 over blocks
    [padded n / 16, k / 2, 16, 2] and `scales` [n, groups] float32 over blocks
    [padded n / 16, groups, 16], padded columns zero. As with bf16_linear's packed weight, the
    views' sizes say the layer's shape; their storage is the blocks."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.q.shape[0])

    @property
    def k(self) -> int:
        return int(self.q.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.untyped_storage().nbytes() + self.scales.untyped_storage().nbytes()


def _padded(n: int) -> int:
    return (n + ITEM_COLUMNS - 1) // ITEM_COLUMNS * ITEM_COLUMNS


def pack(weight: Int8Weight) -> PackedInt8:
    n, k = weight.q.shape
    padded, groups = _padded(n), weight.scales.shape[1]
    q = F.pad(weight.q, (0, 0, 0, padded - n))
    q = q.view(padded // STEP_COLUMNS, STEP_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    scales = F.pad(weight.scales, (0, 0, 0, padded - n))
    scales = scales.view(padded // STEP_COLUMNS, STEP_COLUMNS, groups).permute(0, 2, 1).contiguous()
    return PackedInt8(
        q.view(-1).as_strided((n, k), (k, 1)), scales.view(-1).as_strided((n, groups), (groups, 1))
    )


def unpack(packed: PackedInt8) -> Int8Weight:
    """The inverse of `pack` (for the torch fallback where the kernel does not load)."""
    n, k = packed.n, packed.k
    padded, groups = _padded(n), packed.scales.shape[1]
    blocks = torch.empty(0, dtype=torch.int8).set_(packed.q.untyped_storage())
    q = blocks.view(padded // STEP_COLUMNS, k // 2, STEP_COLUMNS, 2).permute(0, 2, 1, 3)
    scale_blocks = torch.empty(0).set_(packed.scales.untyped_storage())
    scales = scale_blocks.view(padded // STEP_COLUMNS, groups, STEP_COLUMNS).permute(0, 2, 1)
    return Int8Weight(
        q.reshape(padded, k)[:n].contiguous(), scales.reshape(padded, groups)[:n].contiguous()
    )
