"""The W4A16 / W8A16 Triton kernel (kernels/triton/quant_linear.py) under Triton's interpreter
on the CPU, against QuantizedWeight.dequantize (float32): groups of 32 and 128, with and without
mins, 4 and 8 bits, bf16 and fp16 activations, a bias, rows that do not fill a tile.

Decode rows split k over several programs (`split_k`), prefill rows do not: both are run.
Two checks each: with powers-of-two scales and mins and one-hot activations every output is
one weight value (plus the bias), exact in bf16/fp16, so the kernel's output must equal the
reference bit for bit; with random values the difference must stay inside the rounding bound
stated in `_bound`. Shapes are tiny: the
interpreter runs each program in numpy."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # as in tests/kernels/attention
    if os.environ.get("CI"):
        raise RuntimeError("triton is not installed: pip install -e '.[dev]'")
    pytest.skip("triton is not installed", allow_module_level=True)

from kernels.cpu.quant_layout import QuantizedWeight
from kernels.triton import quant_linear as quant_linear_module
from kernels.triton.quant_layout import pack, unfit
from kernels.triton.quant_linear import quant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative rounding of one value to the activations' type: half an ulp on a GPU (round to
# nearest), a whole one allowed because the interpreter's float32 -> bf16 cast truncates.
UNIT = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _weight(
    n: int, k: int, group: int, bits: int, mins: bool, exact: bool, seed: int
) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-127, 128)
    q = torch.randint(low, high, (n, k), generator=gen).to(torch.int8)
    shape = (n, k // group)
    if exact:  # powers of two: q * scale + min (+ a bias of 0.5) fits bf16's 8 bits
        scales = 2.0 ** torch.randint(-6, -2, shape, generator=gen).to(torch.float32)
        offsets = -8.0 * scales if mins else None
    else:
        scales = torch.rand(shape, generator=gen) * 0.05 + 1e-3
        offsets = torch.randn(shape, generator=gen) * 0.1 if mins else None
    return QuantizedWeight(q, scales, offsets, bits)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each weight rounded to x's dtype (|dw| <= UNIT |w|), float32 sums (k * 2^-24 relative),
    and the output rounded to x's dtype (UNIT / 2 of |y| past round-to-nearest's half)."""
    magnitude = x.float().abs() @ w.abs().t()
    k = x.shape[-1]
    return magnitude * (UNIT[dtype] + k * 2.0**-24) + ref.abs() * UNIT[dtype] + 1e-6


CASES = [
    pytest.param(4, 32, True, torch.bfloat16, id="int4-g32-mins-bf16"),
    pytest.param(4, 32, False, torch.float16, id="int4-g32-fp16"),
    pytest.param(4, 128, True, torch.float16, id="int4-g128-mins-fp16"),
    pytest.param(4, 128, False, torch.bfloat16, id="int4-g128-bf16"),
    pytest.param(8, 32, False, torch.bfloat16, id="int8-g32-bf16"),
    pytest.param(8, 256, False, torch.float16, id="int8-per-row-fp16"),
]


@pytest.mark.parametrize("rows", [256, 5], ids=["prefill-tiles", "decode-tiles"])
@pytest.mark.parametrize(("bits", "group", "mins", "dtype"), CASES)
def test_each_weight_comes_out_bit_for_bit(
    bits: int, group: int, mins: bool, dtype: torch.dtype, rows: int
) -> None:
    """x one-hot rows pick single inputs: row j of the output is column j of the weight plus
    the bias, exact in bf16/fp16 with these scales, so any misplaced nibble, group or column
    shows. 256 rows: every input, through the large tiles; 5: the decode tiles."""
    n, k = 80, 256  # n: one full and one partial 64-column tile
    weight = _weight(n, k, group, bits, mins, exact=True, seed=bits * 1000 + group)
    picks = torch.arange(k) if rows == k else torch.tensor([0, 31, 32, 130, 255])
    x = torch.eye(k, dtype=dtype)[picks]
    bias = torch.tensor([-0.5, 0.0, 0.5, 1.0]).repeat(n // 4).to(dtype)
    want = weight.dequantize()[:, picks].t() + bias.float()
    assert torch.equal(want.to(dtype).float(), want)  # exact in the activations' type
    got = quant_linear(x.to(DEVICE), pack(weight).to(DEVICE), bias.to(DEVICE))
    assert got.dtype == dtype and got.shape == (len(picks), n)
    assert torch.equal(got.cpu().float(), want)


@pytest.mark.parametrize(("bits", "group", "mins", "dtype"), CASES)
def test_random_values_stay_inside_the_rounding_bound(
    bits: int, group: int, mins: bool, dtype: torch.dtype
) -> None:
    n, k, m = 48, 256, 3
    weight = _weight(n, k, group, bits, mins, exact=False, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    w = weight.dequantize()
    want = x.float() @ w.t()
    got = quant_linear(x.to(DEVICE), pack(weight).to(DEVICE), None).cpu().float()
    error = (got - want).abs()
    bound = _bound(x, w, want, dtype)
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
    # The bound is not loose enough to hide a wrong weight: a column's error is far below it.
    assert error.max() < 0.05 * want.abs().max()


@pytest.mark.parametrize(("target", "split"), [(3, 3), (1, 1)])
def test_a_decode_step_splits_k_unevenly_or_not_at_all(
    monkeypatch: pytest.MonkeyPatch, target: int, split: int
) -> None:
    """Decode rows split the k steps over programs (8 steps over 3: 3, 3 and 2) and add the
    partial sums after; the same values as one program walking them all."""
    monkeypatch.setattr(quant_linear_module, "TARGET_PROGRAMS", target)
    weight = _weight(48, 256, 32, 4, True, exact=False, seed=11)
    assert quant_linear_module.split_k(2, 48, 256, 32) == split
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    w = weight.dequantize()
    want = x.float() @ w.t() + bias.float()
    got = quant_linear(x.to(DEVICE), pack(weight).to(DEVICE), bias.to(DEVICE)).cpu().float()
    bound = _bound(x, w, want, torch.bfloat16)
    assert ((got - want).abs() <= bound).all()


def test_packing_puts_each_value_in_its_field() -> None:
    """Word layout, read back independently of the kernel: 4-bit value i of a word in bits
    4i..4i+3, along k; 8-bit ones biased by 128."""
    weight = _weight(32, 64, 32, 4, True, exact=True, seed=3)
    packed = pack(weight)
    assert packed.words.shape == (8, 32) and packed.words.dtype == torch.int32
    words = packed.words.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1)  # [8, 8, 32]
    assert torch.equal(fields.reshape(64, 32).t(), weight.q.to(torch.int64))
    assert torch.equal(packed.scales, weight.scales.t()) and packed.mins is not None
    wide = pack(_weight(32, 64, 32, 8, False, exact=True, seed=4))
    assert wide.words.shape == (16, 32)


def test_empty_batch_and_unfit_groups() -> None:
    weight = _weight(32, 64, 32, 4, False, exact=True, seed=5)
    out = quant_linear(torch.empty(0, 64, dtype=torch.bfloat16), pack(weight), None)
    assert out.shape == (0, 32)
    odd = QuantizedWeight(
        torch.zeros(16, 72, dtype=torch.int8), torch.ones(16, 3), None, 4
    )  # groups of 24
    assert unfit(odd) == "its groups of 24 inputs are not a multiple of 16"
    with pytest.raises(ValueError, match="groups of 24"):
        pack(odd)


def test_packing_stays_on_the_weights_device() -> None:
    """--quantization int8 on a GPU quantizes and packs where the weight is; the meta device
    stands in for CUDA here (a CPU tensor mixed in fails on either)."""
    from kernels.cpu.quant_layout import quantize

    packed = pack(quantize(torch.empty(32, 64, device="meta")))
    assert packed.words.device.type == "meta" and packed.scales.device.type == "meta"
