"""FP8 linears (kernels/gpu_quant/fp8.py) on the CPU: torch 2.13 runs `torch._scaled_mm` here, so
this is the code a GPU runs, only the matmul's kernel differs.

Quantizing: every value round-trips as ml_dtypes' float8_e4m3fn (an implementation independent
of torch's) rounds it, bit for bit, and the de-quantized weight is within half an FP8 step of
the original. The matmul: equal to the float32 product of the de-quantized operands up to the
output's rounding, and within a stated bound of the unquantized product."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels.gpu_quant.fp8 import FP8, FP8_MAX, Fp8Weight, fp8_linear, quantize_activations
from kernels.gpu_quant.fp8 import quantize_weight as quantize_fp8

# float8_e4m3fn: 3 mantissa bits, so round to nearest is within 2^-4 of a normal value; below
# 2^-6 (subnormals) the step is 2^-9, so within 2^-10 absolutely.
RELATIVE, SUBNORMAL = 2.0**-4, 2.0**-10


def _ml_dtypes_round(values: torch.Tensor) -> torch.Tensor:
    rounded = values.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(rounded)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_weight_quantization_matches_an_independent_fp8(granularity: str) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 1, 64).unsqueeze(1)
    weight[5] = 0.0  # an all-zero row keeps a usable scale
    fp8 = quantize_fp8(weight.to(torch.bfloat16), granularity)  # type: ignore[arg-type]
    w = weight.to(torch.bfloat16).float()
    assert fp8.q.dtype == FP8 and fp8.scales.shape == ((64,) if granularity == "channel" else (1,))
    scales = fp8.scales.unsqueeze(-1)
    # The same division, rounded by ml_dtypes: the FP8 bits agree everywhere.
    assert torch.equal(fp8.q.float(), _ml_dtypes_round((w / scales).clamp(-FP8_MAX, FP8_MAX)))
    assert fp8.q.float().abs().amax() == FP8_MAX  # the largest value maps to the top
    error = (fp8.dequantize() - w).abs()
    assert (error <= torch.maximum(w.abs() * RELATIVE, scales * SUBNORMAL) * (1 + 1e-6)).all()
    assert torch.equal(fp8.dequantize()[5], torch.zeros(96))


@pytest.mark.parametrize("scheme", ["token", "tensor"])
def test_activation_scales_per_token_or_tensor(scheme: str) -> None:
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[2] = 0.0
    q, scales = quantize_activations(x, scheme)  # type: ignore[arg-type]
    assert scales.shape == ((5, 1) if scheme == "token" else (1, 1))
    rows = [0, 1, 3, 4] if scheme == "token" else [int(x.float().abs().amax(1).argmax())]
    assert (q.float()[rows].abs().amax(dim=1) == FP8_MAX).all()
    assert torch.equal(q.float()[2], torch.zeros(32)) and (scales > 0).all()


@pytest.mark.parametrize(
    ("granularity", "scheme", "dtype"),
    [
        ("channel", "token", torch.bfloat16),  # row-wise scales inside _scaled_mm
        ("channel", "token", torch.float16),  # float32 sums, scaled after (row-wise is bf16 only)
        ("tensor", "tensor", torch.bfloat16),  # _scaled_mm's scalar scales
        ("tensor", "token", torch.float32),
    ],
)
def test_scaled_matmul_is_the_product_of_the_dequantized_operands(
    granularity: str, scheme: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(2)
    n, k, m = 48, 128, 7
    weight = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    fp8 = quantize_fp8(weight.to(dtype), granularity, scheme)  # type: ignore[arg-type]
    got = fp8_linear(x.view(1, m, k), fp8, bias)
    assert got.shape == (1, m, n) and got.dtype == dtype
    xq, x_scales = quantize_activations(x, fp8.activations)
    exact = (xq.float() * x_scales) @ fp8.dequantize().t()
    output_unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}
    bound = exact.abs() * output_unit[dtype] + 1e-5 * (xq.float().abs() @ fp8.q.float().abs().t())
    assert ((got[0].float() - bias.float() - exact).abs() <= bound * 2 + 1e-6).all()
    # Against the unquantized product: each operand within 2^-4 relatively (normal values), so
    # each product term within 2^-3 of its own magnitude.
    plain = x.float() @ weight.to(dtype).float().t()
    terms = x.float().abs() @ weight.to(dtype).float().abs().t()
    assert ((got[0].float() - bias.float() - plain).abs() <= terms * 2.0**-3 + 0.02).all()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_fp8(torch.ones(20, 32))
    with pytest.raises(ValueError, match="one per row"):
        Fp8Weight(torch.zeros(16, 16).to(FP8), torch.ones(3))
