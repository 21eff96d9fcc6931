"""4-bit and 8-bit linears with int8 activations (kernels/cpu/quant_linear.cpp,
--quantize-activations int8): the kernel's rounding of the activations equals the torch reference
bit for bit; its output equals a float64 evaluation of the same formula (int8 blocks of 32, exact
integer dot products, the activation and weight scales, the mins times the rounded inputs' sums)
within float32 rounding, through the VNNI code and the portable loop, for decode and prefill row
counts, groups of 32, 128 and the whole row, with and without mins, column counts off the
32-column blocks; 8-bit weights at their extremes (-128 and 127, where the VNNI code's q + 128
offset is 0 and 255) against activations at +-127; it is really the integer path (off the exact
path by the activations' rounding, not zero); the torch fallback agrees; and what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import quant_layout
from kernels.cpu.activation_quant import BLOCK, quantize_activations, reference_int8_linear
from kernels.cpu.extension import KernelUnavailable
from kernels.cpu.quant_layout import PackedWeight, QuantizedWeight

try:
    from kernels.cpu import quant_linear
except KernelUnavailable:  # pragma: no cover - the torch fallback is checked below
    quant_linear = None  # type: ignore[assignment]

needs_kernel = pytest.mark.skipif(quant_linear is None, reason="quant_linear not built here")

ROW_COUNTS = [1, 7, 8, 16, 65, 300]  # 300: a second block of rows (row0 > 0)
K = 256  # 8 activation blocks: 8 groups of 32, or 2 of 128
N = 45  # one 32-column item and a part of the next


def _weight(
    group: int, with_mins: bool, seed: int, bits: int = 4
) -> tuple[QuantizedWeight, PackedWeight]:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (N, K), generator=gen).to(torch.int8)
    else:  # every int8, the extremes certainly among them
        q = torch.randint(-128, 128, (N, K), generator=gen).to(torch.int8)
        q[0, :] = -128
        q[1, :] = 127
    scales = torch.rand(N, K // group, generator=gen) * 0.02 + 0.001
    mins = -torch.rand(N, K // group, generator=gen) * 0.2 if with_mins else None
    weight = QuantizedWeight(q, scales, mins, bits=bits)
    return weight, quant_layout.pack(weight)


def _inputs(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=gen) * 3
    x[0, :BLOCK] = 0  # a block of zeros: d = 0, values 0
    return x


def _float64_reference(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in float64 (exact but for the last bits), and the sum of its terms'
    magnitudes, which bounds float32's rounding of the kernel's sums."""
    rows, groups = x.shape[0], weight.scales.shape[1]
    values, d = quantize_activations(x)
    blocks = K // BLOCK
    q = weight.q.to(torch.int64).view(N, blocks, BLOCK)
    a = values.to(torch.int64).view(rows, blocks, BLOCK)
    dots = torch.einsum("rbi,nbi->rnb", a, q).to(torch.float64)  # exact integers
    scale = weight.scales.to(torch.float64).repeat_interleave(blocks // groups, dim=1)
    terms = dots * d.to(torch.float64).unsqueeze(1) * scale.unsqueeze(0)
    out, magnitude = terms.sum(-1), terms.abs().sum(-1)
    if weight.mins is not None:
        # The min times the group's sum of the rounded inputs: d x each block's integer sum.
        block_sums = a.sum(-1).to(torch.float64) * d.to(torch.float64)  # [rows, blocks]
        grouped = block_sums.view(rows, groups, blocks // groups)
        mins = weight.mins.to(torch.float64)
        out = out + grouped.sum(-1) @ mins.T
        # The group's float32 sum: its terms' magnitudes, times the min.
        magnitude = magnitude + grouped.abs().sum(-1) @ mins.abs().T
    return out + bias.to(torch.float64), magnitude


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_rounding_equals_the_torch_reference_bit_for_bit(
    dtype: torch.dtype, portable: bool
) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 4 * BLOCK, generator=gen) * 5).to(dtype)
    x[1, :BLOCK] = 0
    # Halves: x / d lands on .5 in each of these blocks (max 127 -> d = 1), ties to even.
    x[2, :BLOCK] = torch.tensor([127.0, 2.5, -2.5, 3.5, 0.5, -0.5] + [1.0] * (BLOCK - 6))
    x[3, :BLOCK] = torch.full((BLOCK,), -1e-30).to(dtype)  # tiny but not zero
    values, scales = quant_linear.quantize_activations(x, portable)
    want_values, want_scales = quantize_activations(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(values, want_values)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    assert scales[1, 0] == 0 and not values[1, :BLOCK].any()
    assert values[2, :6].tolist() == [127, 2, -2, 4, 0, 0]
    # Every block that is not zeros reaches +-127.
    peaks = values.to(torch.int32).abs().view(9, 4, BLOCK).amax(-1)
    assert torch.equal(peaks, torch.where(scales > 0, 127, 0).to(torch.int32))


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("with_mins", [True, False], ids=["mins", "no-mins"])
@pytest.mark.parametrize("group", [32, 128, K], ids=["g32", "g128", "row"])
@pytest.mark.parametrize("bits", [4, 8])
def test_output_equals_the_float64_formula(
    bits: int, group: int, with_mins: bool, portable: bool
) -> None:
    if not portable and not quant_linear.VNNI:
        pytest.skip("this CPU lacks AVX512-VNNI/VBMI: only the portable loop runs here")
    weight, packed = _weight(group, with_mins, seed=group + with_mins, bits=bits)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    run = quant_linear.linear_portable if portable else quant_linear.linear
    for rows in ROW_COUNTS:
        x = _inputs(rows, seed=rows)
        want, magnitude = _float64_reference(x, weight, bias)
        got = run(x, packed, bias, True).to(torch.float64)
        # float32 sums of K / 32 + 2 terms a group (and of the group's inputs): each rounding at
        # most 2^-24 of the running magnitude.
        bound = (K + 4) * 2.0**-24 * (magnitude + bias.abs().to(torch.float64))
        assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max())
        if not portable and 0 < quant_linear.TILE_ROWS <= rows:
            continue  # bf16 rows that many take the AMX matmul (below), not integer products
        # bf16 activations: the same, the result rounded once to bf16.
        xb = x.to(torch.bfloat16)
        want_b, magnitude_b = _float64_reference(xb.float(), weight, bias)
        got_b = run(xb, packed, bias, True).to(torch.float64)
        bound_b = (K + 4) * 2.0**-24 * (magnitude_b + bias.abs()) + want_b.abs() * 2.0**-8
        assert ((got_b - want_b).abs() <= bound_b).all(), (rows, (got_b - want_b).abs().max())


@needs_kernel
@pytest.mark.parametrize("int8_activations", [True, False], ids=["int8", "exact"])
@pytest.mark.parametrize("bits", [4, 8])
def test_many_bf16_rows_take_the_de_quantized_weight_on_amx(
    bits: int, int8_activations: bool
) -> None:
    """On a build with AMX, from TILE_ROWS bf16 rows on, the weight is de-quantized into bf16 and
    multiplied by torch: the output is the bf16-rounded weights' float32 product, rounded to bf16,
    in both modes (so with int8 activations the rows are not rounded there)."""
    if quant_linear.TILE_ROWS == 0:
        pytest.skip("a build without AMX: every row count takes this file's own paths")
    weight, packed = _weight(32, True, seed=11, bits=bits)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(12))
    dense = weight.dequantize().to(torch.bfloat16).to(torch.float64)
    for rows in (quant_linear.TILE_ROWS, 300):
        x = _inputs(rows, seed=13).to(torch.bfloat16)
        want = x.to(torch.float64) @ dense.T + bias.to(torch.float64)
        got = quant_linear.linear(x, packed, bias, int8_activations).to(torch.float64)
        magnitude = x.to(torch.float64).abs() @ dense.abs().T + bias.abs().to(torch.float64)
        # float32 sums, then bf16 twice (the product, then with the bias added).
        bound = K * 2.0**-24 * magnitude + 2 * (want.abs() + bias.abs()) * 2.0**-8
        assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max())
    # One row fewer takes the integer products: off the de-quantized product by the rounding.
    x = _inputs(quant_linear.TILE_ROWS - 1, seed=13).to(torch.bfloat16)
    below = quant_linear.linear(x, packed, bias, True).to(torch.float64)
    exact = x.to(torch.float64) @ dense.T + bias.to(torch.float64)
    assert (below - exact).abs().max() > 1e-2


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_it_is_the_integer_path_off_the_exact_one_by_the_activation_rounding(bits: int) -> None:
    weight, packed = _weight(32, True, seed=5, bits=bits)
    x = _inputs(16, seed=6)
    exact = F.linear(x, weight.dequantize())
    got = quant_linear.linear(x, packed, None, True)
    # Each input moves by at most half its block's scale: the output by at most that times the
    # weight's magnitudes (plus float32 rounding).
    _, d = quantize_activations(x)
    step = (d / 2).repeat_interleave(BLOCK, dim=1)
    bound = step @ weight.dequantize().abs().T + 1e-4
    diff = (got - exact).abs()
    assert (diff <= bound).all()
    assert diff.max() > 1e-3  # not the exact path: rounding 16 x 256 inputs shows


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_the_torch_fallback_agrees_with_the_kernel(bits: int) -> None:
    weight, packed = _weight(128, True, seed=7, bits=bits)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(8))
    x = _inputs(8, seed=9)
    want, magnitude = _float64_reference(x, weight, bias)
    bound = (K + 4) * 2.0**-24 * (magnitude + bias.abs())
    got = reference_int8_linear(x, packed, bias).to(torch.float64)
    assert ((got - want).abs() <= bound).all()
    kernel = quant_linear.linear(x, packed, bias, True).to(torch.float64)
    assert ((got - kernel).abs() <= 2 * bound).all()


@needs_kernel
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
def test_8_bit_extremes_against_activations_at_127(portable: bool) -> None:
    """Every product at its largest: q = -128 or 127 (the VNNI code's unsigned 0 or 255) against
    activations that all round to +-127, so each block's int32 sum is exactly 32 x 127 x q (or,
    with alternating signs, 0): the 128 offset must come off exactly."""
    if not portable and not quant_linear.VNNI:
        pytest.skip("this CPU lacks AVX512-VNNI/VBMI: only the portable loop runs here")
    q = torch.empty(N, K, dtype=torch.int8)
    q[0::2], q[1::2] = -128, 127
    scales = torch.full((N, 1), 2.0**-10)
    weight = QuantizedWeight(q, scales, bits=8)
    x = torch.full((3, K), 0.5)
    x[1] = -0.5
    x[2, 1::2] = -0.5  # alternating: each block's sum of a is 0
    values, _ = quantize_activations(x)
    assert values.abs().min() == 127
    run = quant_linear.linear_portable if portable else quant_linear.linear
    got = run(x, quant_layout.pack(weight), None, True)
    d = 0.5 / 127.0  # the float32 scale: its exact value
    dd = float(torch.tensor(d, dtype=torch.float32))
    col = torch.tensor([-128.0 if c % 2 == 0 else 127.0 for c in range(N)], dtype=torch.float64)
    want = torch.stack([col, -col, torch.zeros(N, dtype=torch.float64)]) * K * 127 * dd * 2.0**-10
    assert torch.allclose(got.to(torch.float64), want, rtol=2.0**-20, atol=0)


@needs_kernel
def test_groups_of_16_are_refused() -> None:
    x = torch.randn(2, 64)
    q = torch.randint(0, 16, (32, 64)).to(torch.int8)
    sixteen = quant_layout.pack(QuantizedWeight(q, torch.rand(32, 4), None, bits=4))
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        quant_linear.linear(x, sixteen, None, True)
    eight = quant_layout.pack(quant_layout.quantize(torch.randn(32, 64), 16))
    with pytest.raises(RuntimeError, match="groups of a multiple of 32"):
        quant_linear.linear(x, eight, None, True)
