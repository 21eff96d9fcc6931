"""Integers packed into int32 words, as quantized checkpoints store them (compressed-tensors'
pack-quantized, GPTQ and AWQ): value i of a word in bits [i * bits, (i + 1) * bits), the word's
lowest bits first."""

from __future__ import annotations

import torch


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned values (int32, 0 .. 2**bits - 1) of int32 `words` packed along `dim` (1:
    each row's words hold consecutive columns; 0: each column's words hold consecutive rows)."""
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit values: 4 or 8")
    w = words.to(torch.int32)
    w = w if dim == 1 else w.t()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # An arithmetic shift copies the sign bit down; the mask keeps only the value's own bits
    # (in place: the values are 4 bytes a weight, a layer's at load up to ~100 MB).
    values = w.unsqueeze(-1) >> shifts
    values &= (1 << bits) - 1
    values = values.reshape(w.shape[0], w.shape[1] * (32 // bits))
    return values if dim == 1 else values.t()
