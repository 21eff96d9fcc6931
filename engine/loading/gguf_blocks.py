"""GGUF's quantized block types as the quantized kernel's integers, float32 scales and mins
(kernels/cpu/quant_layout), decoded from the raw bytes with numpy, never through bf16.

Each decoder computes a group's scale (and min) in float32 the way ggml's own de-quantization
does (K-quants: the super-block's float16 d times the sub-block's integer scale), so that
q * scale + min is ggml's value bit for bit. What each block type becomes:

- Q8_0: 8-bit, groups of 32.
- Q4_0, Q4_1: 4-bit, groups of 32 (Q4_0's offset of 8 as a min of -8 * d).
- Q5_0, Q5_1: 5-bit values stored as 8-bit, groups of 32 (Q5_0 with its offset of 16 taken
  out of the integers: d * (q - 16) exactly as ggml computes it).
- Q4_K: 4-bit, groups of 32 with mins (d * sc, -dmin * m), the 4-bit layout unchanged.
- Q5_K: as Q4_K with a fifth bit, stored as 8-bit.
- Q6_K: 8-bit (q - 32), groups of 16, no mins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu.quant_layout import QuantizedWeight


@dataclass(frozen=True)
class BlockType:
    values: int  # a block's values, along a row
    nbytes: int  # a block's bytes in the file
    decode: Callable[[np.ndarray], QuantizedWeight]  # [rows, blocks, nbytes] uint8 -> weight


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes of a little-endian float16 -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[..., b] bytes -> [..., 2b]: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([raw & 0x0F, raw >> 4], axis=-1)


def _weight(
    q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int
) -> QuantizedWeight:
    rows = q.shape[0]
    return QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1).astype(np.int8))),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32)),
        None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1), dtype=np.float32)),
        bits,
    )


def _q8_0(blocks: np.ndarray) -> QuantizedWeight:
    return _weight(blocks[..., 2:].view(np.int8), _f16(blocks[..., :2]), None, 8)


def _q4_0(blocks: np.ndarray) -> QuantizedWeight:
    d = _f16(blocks[..., :2])
    return _weight(_nibbles(blocks[..., 2:]), d, d * np.float32(-8.0), 4)


def _q4_1(blocks: np.ndarray) -> QuantizedWeight:
    return _weight(_nibbles(blocks[..., 4:]), _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 4)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes whose bit j (little-endian) is value j's fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0(blocks: np.ndarray) -> QuantizedWeight:
    q = _nibbles(blocks[..., 6:]) | (_fifth_bits(blocks[..., 2:6]) << 4)
    return _weight(q.astype(np.int8) - 16, _f16(blocks[..., :2]), None, 8)


def _q5_1(blocks: np.ndarray) -> QuantizedWeight:
    q = _nibbles(blocks[..., 8:]) | (_fifth_bits(blocks[..., 4:8]) << 4)
    return _weight(q, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes holding 8 six-bit scales and 8 six-bit mins. Sub-blocks 0-3: the low
    6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7: the nibbles of bytes 8-11
    (low: scale, high: min) below the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_bits(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes, four runs of 32: run r holds sub-block 2r in its low nibbles and
    2r + 1 in its high ones. [..., 128] -> [..., 8, 32]."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return _nibbles(runs).reshape(*qs.shape[:-1], 8, 32)


def _k_scaled(blocks: np.ndarray, q: np.ndarray, bits: int) -> QuantizedWeight:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    # ggml: (d * sc) * q - (dmin * m), each product rounded to float32 as here.
    return _weight(q, d[..., None] * sc, -(dmin[..., None] * m), bits)


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    return _k_scaled(blocks, _k_low_bits(blocks[..., 16:144]), 4)


def _q5_k(blocks: np.ndarray) -> QuantizedWeight:
    # 32 bytes of fifth bits: bit j of byte i is sub-block j's value i.
    qh = blocks[..., 16:48]
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _k_scaled(blocks, _k_low_bits(blocks[..., 48:176]) | (fifth << 4), 8)


def _q6_k(blocks: np.ndarray) -> QuantizedWeight:
    # Two halves of 128 values. Half h: 64 bytes of low 4 bits (values 0-63 in the low nibbles,
    # 64-127 in the high ones) and 32 bytes of high 2 bits (values 32s + i at bits 2s of byte i).
    lead = blocks.shape[:-1]
    low = _nibbles(blocks[..., 0:128].reshape(*lead, 2, 64))
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(*lead, 2, 128)
    q = (low | (high << 4)).astype(np.int8) - 32
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    return _weight(q, _f16(blocks[..., 208:210])[..., None] * sc, None, 8)


BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(32, 34, _q8_0),
    "Q4_0": BlockType(32, 18, _q4_0),
    "Q4_1": BlockType(32, 20, _q4_1),
    "Q5_0": BlockType(32, 22, _q5_0),
    "Q5_1": BlockType(32, 24, _q5_1),
    "Q4_K": BlockType(256, 144, _q4_k),
    "Q5_K": BlockType(256, 176, _q5_k),
    "Q6_K": BlockType(256, 210, _q6_k),
}


def decode(kind: str, raw: np.ndarray) -> QuantizedWeight:
    """A tensor's rows of `kind` blocks ([rows, bytes] uint8) as the kernel's weight."""
    block = BLOCK_TYPES[kind]
    data = np.ascontiguousarray(raw, dtype=np.uint8)
    return block.decode(data.reshape(data.shape[0], -1, block.nbytes))
