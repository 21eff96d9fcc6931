"""The weight-only quantized linear (kernels/cpu/quant_linear.cpp) against a float32 matmul of
the de-quantized weight: int8 per-channel and in GGUF Q8_0-sized groups of 32, 4-bit with mins
(Q4_1, Q4_K) and without, 8-bit with mins (Q5_K, or a fused layer joining 8- and 4-bit parts),
groups of 16 (Q6_K, and a fused layer joining it to Q4_K) with and without mins; decode and
prefill row counts, output sizes off its 32-column blocks, odd group counts, with and without a
bias, bf16 and float32 activations, through the vector code and the portable loop; the layout
round trip; and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import quant_layout
from kernels.cpu.extension import KernelUnavailable
from kernels.cpu.quant_layout import QuantizedWeight
from kernels.cpu.quant_linear_reference import reference_linear

try:
    from kernels.cpu import quant_linear
except KernelUnavailable:  # pragma: no cover - the torch fallback is checked by the engine tests
    quant_linear = None  # type: ignore[assignment]

needs_kernel = pytest.mark.skipif(quant_linear is None, reason="quant_linear not built here")

# Decode steps, one past the register tiles (4 and 8), and prefill-sized ones across row blocks.
ROW_COUNTS = [0, 1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 300]
# (out, in): a column count one past a block and one short of one, a single odd group count
# (96 / 32 = 3, 48 / 16 = 3), and the default model's MLP shape.
SHAPES = [(64, 64), (33, 96), (17, 64), (31, 32), (31, 48), (576, 1536)]
FORMATS = ["int8", "q8_0", "q4_1", "q4", "8-bit+mins", "q6_k", "8-bit+mins/16", "4-bit+mins/16"]
# Random integers: format -> (bits, lowest, highest, group, with mins). q6_k: GGUF's Q6_K (q - 32,
# groups of 16); 8-bit+mins: Q5_K, Q5_1, or a fused layer joining 8- and 4-bit parts;
# 8-bit+mins/16: a fused layer joining Q4_K (or Q5_K) and Q6_K parts.
RANDOM_FORMATS = {
    "q4_1": (4, 0, 15, 32, True),
    "q4": (4, 0, 15, 32, False),
    "8-bit+mins": (8, -127, 127, 32, True),
    "q6_k": (8, -32, 31, 16, False),
    "8-bit+mins/16": (8, -32, 31, 16, True),
    "4-bit+mins/16": (4, 0, 15, 16, True),
}


def _group(fmt: str) -> int:
    return {"int8": 2, "q8_0": 32}.get(fmt) or RANDOM_FORMATS[fmt][3]


# Every format on every shape its groups divide; the large shape for the first formats only
# (the small ones already cross the row tiles and column blocks).
CASES = [
    (fmt, n, k)
    for fmt in FORMATS
    for n, k in SHAPES
    if k % _group(fmt) == 0 and (n < 500 or fmt in FORMATS[:5])
]


def _weight(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    if fmt in ("int8", "q8_0"):
        return quant_layout.quantize(
            torch.randn(n, k, generator=gen), None if fmt == "int8" else 32
        )
    bits, low, high, group, with_mins = RANDOM_FORMATS[fmt]
    q = torch.randint(low, high + 1, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.2
    mins = -torch.rand(n, k // group, generator=gen) if with_mins else None
    return QuantizedWeight(q, scales, mins, bits=bits)


def test_quantize_rounds_to_nearest_within_half_a_step() -> None:
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    quantized = quant_layout.quantize(weight, 32)
    step = quantized.scales.repeat_interleave(32, dim=1)
    assert bool(((quantized.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    # Each group's largest magnitude is 127 exactly, so the scale is that magnitude / 127.
    assert bool((quantized.q.view(40, 2, 32).abs().amax(-1) == 127).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_then_unpack_is_the_identity_and_pads_with_zeros(fmt: str) -> None:
    weight = _weight(fmt, 45, 96, seed=2)
    packed = quant_layout.pack(weight)
    # The layer's shape, over blocks of 16 columns padded to 64 (two blocks a work item).
    row_bytes = 48 if weight.bits == 4 else 96
    assert packed.q.shape == (45, row_bytes) and packed.k == 96 and packed.bits == weight.bits
    assert packed.q.untyped_storage().nbytes() == 64 * row_bytes
    assert packed.scales.untyped_storage().nbytes() == 64 * weight.scales.shape[1] * 4
    back = quant_layout.unpack(packed)
    assert torch.equal(back.q, weight.q) and torch.equal(back.scales, weight.scales)
    assert (back.mins is None) == (weight.mins is None)
    if weight.mins is not None:
        assert back.mins is not None and torch.equal(back.mins, weight.mins)
    storage = torch.empty(0, dtype=packed.q.dtype).set_(packed.q.untyped_storage())
    blocks = storage.view(4, 48, 2 * row_bytes // 96 * 16)
    assert not bool(blocks[3].any())  # columns 48..63 (and 45..47 within block 2)


def test_weights_that_do_not_fit_their_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="groups of an even size"):
        QuantizedWeight(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 5))
    with pytest.raises(ValueError, match="mins are float32 and shaped as the scales"):
        QuantizedWeight(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 3), torch.ones(4, 2))
    with pytest.raises(ValueError, match="do not split"):
        quant_layout.quantize(torch.zeros(4, 96), group=64)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, out_features, in_features", CASES)
def test_every_row_count_against_the_dequantized_float32_matmul(
    dtype: torch.dtype, fmt: str, out_features: int, in_features: int
) -> None:
    assert quant_linear is not None
    weight = _weight(fmt, out_features, in_features, seed=out_features + in_features)
    packed = quant_layout.pack(weight)
    reference = weight.dequantize()
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(out_features, generator=gen)
    rows_list = ROW_COUNTS if out_features < 500 else [1, 16, 65, 130]
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        want = F.linear(x.float(), reference, bias)
        for name, run in (
            ("vector", quant_linear.linear),
            ("portable", quant_linear.linear_portable),
        ):
            for b in (None, bias):
                got = run(x, packed, b)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                expected = want if b is not None else want - bias
                if dtype == torch.float32:  # only the order of the float32 sums differs
                    scale = float(reference.abs().max()) * in_features**0.5
                    torch.testing.assert_close(
                        got, expected, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} {rows} rows"
                    )
                    continue
                # bf16: the output rounded once (half a unit in 8 bits); from 8 rows with groups
                # and past 64 without, each weight is rounded to bf16 too: at most that relative
                # error a product.
                magnitude = x.float().abs() @ reference.abs().T
                bound = 2**-8 * (expected.abs() + magnitude) + 1e-6
                error = (got.float() - expected).abs()
                assert bool((error <= bound).all()), f"{name} {rows} rows: {error.max()}"


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_and_the_torch_fallback_agree(fmt: str) -> None:
    assert quant_linear is not None
    packed = quant_layout.pack(_weight(fmt, 100, 128, seed=3))
    bias = torch.randn(100)
    x = torch.randn(5, 128)
    want = reference_linear(x, packed, bias)
    torch.testing.assert_close(quant_linear.linear(x, packed, bias), want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_inputs_that_do_not_match_the_weight_are_refused() -> None:
    assert quant_linear is not None
    packed = quant_layout.pack(_weight("int8", 32, 64, seed=4))
    with pytest.raises(RuntimeError, match="quant_linear: q is"):
        quant_linear.linear(torch.randn(2, 32), packed, None)  # 32 inputs, the weight takes 64
    with pytest.raises(RuntimeError, match="contiguous 2-d bf16 or float32"):
        quant_linear.linear(torch.randn(2, 64, dtype=torch.float64), packed, None)
    with pytest.raises(RuntimeError, match="bias is n contiguous float32"):
        quant_linear.linear(torch.randn(2, 64), packed, torch.randn(31))
