"""The layout the Triton quantized linear (kernels/triton/quant_linear.py) reads, in plain torch
(packing needs no Triton, so loaders and CPU-only installs can import it).

The integers of a QuantizedWeight [n, k] are packed along k into int32 words, 8 nibbles (4-bit)
or 4 bytes (8-bit) a word, stored [k / per_word, n] so that a warp's loads of one word row are
contiguous along n; value i of a word sits in bits [bits*i, bits*(i+1)). 8-bit values are
stored biased by 128 (so that every field is unsigned). Scales and mins are [groups, n] float32,
contiguous along n for the same reason."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu.quant_layout import QuantizedWeight


@dataclass(frozen=True)
class PackedQuantWeight:
    """A QuantizedWeight in the Triton kernel's layout (module docstring)."""

    words: torch.Tensor  # int32 [k / per_word, n]
    scales: torch.Tensor  # float32 [groups, n]
    mins: torch.Tensor | None  # float32 [groups, n]
    bits: int
    n: int
    k: int

    @property
    def group(self) -> int:
        return self.k // self.scales.shape[0]

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.nbytes
        return self.words.nbytes + self.scales.nbytes + mins

    def to(self, device: torch.device | str) -> PackedQuantWeight:
        mins = None if self.mins is None else self.mins.to(device)
        return PackedQuantWeight(
            self.words.to(device), self.scales.to(device), mins, self.bits, self.n, self.k
        )


def unfit(weight: QuantizedWeight) -> str | None:
    """Why the kernel cannot take this weight, or None."""
    if weight.group % 16:
        return f"its groups of {weight.group} inputs are not a multiple of 16"
    return None


def pack(weight: QuantizedWeight) -> PackedQuantWeight:
    why_not = unfit(weight)
    if why_not is not None:
        raise ValueError(f"a [{weight.q.shape[0]}, {weight.q.shape[1]}] weight: {why_not}")
    n, k = weight.q.shape
    bits = weight.bits
    per_word = 32 // bits
    values = weight.q.to(torch.int64) + (128 if bits == 8 else 0)
    fields = values.t().reshape(k // per_word, per_word, n)  # [word row, field, column]
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device).view(1, per_word, 1)
    shifts = shifts * bits
    words = (fields << shifts).sum(dim=1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement
    mins = None if weight.mins is None else weight.mins.t().contiguous()
    return PackedQuantWeight(words.contiguous(), weight.scales.t().contiguous(), mins, bits, n, k)
