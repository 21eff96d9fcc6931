"""The quantized CPU linear's decode path with bf16 activations (kernels/cpu/quant_linear.cpp,
below 65 rows): its products are exact in float32, 4-bit steps widened as 128 + q with the
offset taken out through each group's input sum, so the outputs are the float32 matmul of the
de-quantized weights rounded once to bf16, up to a float32 summation error. Checked at a bound
far tighter than the bf16 rounding of the weights (which the prefill path, from 65 rows, takes),
for 4-bit with and without mins, 8-bit with mins, groups of 8, 16 and 32, tiles of 8 rows and
their remainders."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import quant_layout
from kernels.cpu.extension import KernelUnavailable
from kernels.cpu.quant_layout import QuantizedWeight

try:
    from kernels.cpu import quant_linear
except KernelUnavailable:  # pragma: no cover - the torch fallback is checked by the engine tests
    quant_linear = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(quant_linear is None, reason="quant_linear not built here")

# Tiles of 8 rows, one short and one past, up to the last decode row count.
ROWS = [1, 3, 7, 8, 9, 16, 17, 64]
# (bits, group, with mins)
FORMATS = [
    (4, 32, True),
    (4, 32, False),
    (4, 16, True),
    (4, 8, False),
    (8, 16, True),
    (8, 32, False),
]


def _weight(bits: int, group: int, with_mins: bool, n: int, k: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(bits * 100 + group)
    low, high = (0, 16) if bits == 4 else (-127, 128)
    q = torch.randint(low, high, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.2 + 0.01
    mins = -torch.rand(n, k // group, generator=gen) if with_mins else None
    return QuantizedWeight(q, scales, mins, bits=bits)


@pytest.mark.parametrize(("bits", "group", "with_mins"), FORMATS)
def test_decode_rows_are_the_float32_matmul_rounded_once(
    bits: int, group: int, with_mins: bool
) -> None:
    assert quant_linear is not None
    n, k = 72, 576  # a column block past two work items; 576 inputs, as the default model's
    weight = _weight(bits, group, with_mins, n, k)
    packed = quant_layout.pack(weight)
    reference = weight.dequantize()
    # What the sums run over: |w|, and for 4-bit the 128 x scale each product carries.
    offset = 128.0 if bits == 4 else 0.0
    spread = reference.abs() + offset * weight.scales.repeat_interleave(group, dim=1)
    if weight.mins is not None:
        spread = spread + weight.mins.abs().repeat_interleave(group, dim=1)
    gen = torch.Generator().manual_seed(11)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        expected = F.linear(x.float(), reference)
        got = quant_linear.linear(x, packed, None).float()
        # Half a bf16 unit of the output, and float32 sums: 2^-18 of their terms' magnitudes,
        # where rounding each weight to bf16 would err by ~2^-9 of each product.
        bound = 2**-8 * expected.abs() + 2**-18 * (x.float().abs() @ spread.T)
        error = (got - expected).abs()
        assert bool((error <= bound).all()), f"{rows} rows: {float((error - bound).max())} over"
