"""The weight-only int8 linear (kernels/cpu/int8_linear.cpp) against a float32 matmul of the
de-quantized weight: per-channel and GGUF Q8_0-sized groups of 32, decode and prefill row
counts, output sizes off its 32-column blocks, odd group counts, with and without a bias, bf16
and float32 activations, through the vector code and the portable loop; the layout round trip;
and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import int8_layout
from kernels.cpu.extension import KernelUnavailable
from kernels.cpu.int8_linear_reference import reference_linear

try:
    from kernels.cpu import int8_linear
except KernelUnavailable:  # pragma: no cover - the torch fallback is checked by the engine tests
    int8_linear = None  # type: ignore[assignment]

needs_kernel = pytest.mark.skipif(int8_linear is None, reason="int8_linear not built here")

# Decode steps, one past the register tiles (4 and 8), and prefill-sized ones across row blocks.
ROW_COUNTS = [0, 1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 300]
# (out, in, group): per-channel (None), Q8_0's 32, a single odd group count (96 / 32 = 3), a
# column count one past a block and one short of one, and the default model's MLP shape.
SHAPES = [(64, 64, None), (33, 96, 32), (17, 66, None), (31, 32, 32), (576, 1536, 32)]


def _case(
    out_features: int, in_features: int, group: int | None, seed: int
) -> tuple[torch.Tensor, int8_layout.Int8Weight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    return weight, int8_layout.quantize(weight, group), bias


def test_quantize_rounds_to_nearest_within_half_a_step() -> None:
    weight, quantized, _ = _case(40, 64, 32, seed=1)
    step = quantized.scales.repeat_interleave(32, dim=1)
    error = (quantized.dequantize() - weight).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    # Each group's largest magnitude is 127 exactly, so the scale is that magnitude / 127.
    assert bool((quantized.q.view(40, 2, 32).abs().amax(-1) == 127).all())


def test_pack_then_unpack_is_the_identity_and_pads_with_zeros() -> None:
    _, quantized, _ = _case(45, 96, 32, seed=2)
    packed = int8_layout.pack(quantized)
    # The layer's shape, over blocks of 16 columns padded to 64 (two blocks a work item).
    assert packed.q.shape == (45, 96) and packed.scales.shape == (45, 3)
    assert packed.q.untyped_storage().nbytes() == 64 * 96
    assert packed.scales.untyped_storage().nbytes() == 64 * 3 * 4
    back = int8_layout.unpack(packed)
    assert torch.equal(back.q, quantized.q) and torch.equal(back.scales, quantized.scales)
    blocks = torch.empty(0, dtype=torch.int8).set_(packed.q.untyped_storage()).view(4, 48, 16, 2)
    assert not bool(blocks[2, :, 13:].any()) and not bool(blocks[3].any())  # columns 45..63


def test_scales_that_do_not_split_the_row_are_refused() -> None:
    with pytest.raises(ValueError, match="groups of an even size"):
        int8_layout.Int8Weight(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 5))
    with pytest.raises(ValueError, match="do not split"):
        int8_layout.quantize(torch.zeros(4, 96), group=64)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features, group", SHAPES)
def test_every_row_count_against_the_dequantized_float32_matmul(
    dtype: torch.dtype, out_features: int, in_features: int, group: int | None
) -> None:
    assert int8_linear is not None
    _, quantized, bias = _case(out_features, in_features, group, seed=out_features + in_features)
    packed = int8_layout.pack(quantized)
    reference = quantized.dequantize()
    gen = torch.Generator().manual_seed(7)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        want = F.linear(x.float(), reference, bias)
        for name, run in (
            ("vector", int8_linear.linear),
            ("portable", int8_linear.linear_portable),
        ):
            for b in (None, bias):
                got = run(x, packed, b)
                assert got.dtype == dtype and got.shape == (rows, out_features)
                expected = want if b is not None else want - bias
                # float32: only the order of the float32 sums differs from the reference's.
                # bf16 out: one rounding of that (half a unit in 8 bits), products exact.
                rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-8, 1e-4)
                torch.testing.assert_close(
                    got.float(),
                    expected,
                    rtol=rtol,
                    atol=atol * in_features**0.5,
                    msg=f"{name} {rows} rows",
                )


@needs_kernel
def test_vector_and_portable_agree_with_the_torch_fallback() -> None:
    assert int8_linear is not None
    _, quantized, bias = _case(100, 128, 32, seed=3)
    packed = int8_layout.pack(quantized)
    x = torch.randn(5, 128)
    want = reference_linear(x, packed, bias)
    torch.testing.assert_close(int8_linear.linear(x, packed, bias), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        int8_linear.linear_portable(x, packed, bias), want, rtol=1e-5, atol=1e-4
    )


@needs_kernel
def test_inputs_that_do_not_match_the_weight_are_refused() -> None:
    assert int8_linear is not None
    packed = int8_layout.pack(_case(32, 64, None, seed=4)[1])
    with pytest.raises(RuntimeError, match="int8_linear: q is"):
        int8_linear.linear(torch.randn(2, 32), packed, None)  # 32 inputs, the weight takes 64
    with pytest.raises(RuntimeError, match="contiguous 2-d bf16 or float32"):
        int8_linear.linear(torch.randn(2, 64, dtype=torch.float64), packed, None)
    with pytest.raises(RuntimeError, match="bias is n contiguous float32"):
        int8_linear.linear(torch.randn(2, 64), packed, torch.randn(31))
