"""FP8 (float8_e4m3fn) linears, vLLM's `--quantization fp8` of a bf16/fp16 checkpoint: weights
quantized once at load with a float32 scale per output channel (or one per tensor), activations
quantized at every call with a scale per token (or one per tensor), and the product of the two
through `torch._scaled_mm`, which applies both scales to the float32 sums. The same function runs
on a CPU (torch 2.13 runs `_scaled_mm` there too), which is how the tests check it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# The smallest scale an activation row gets: an all-zero row must not divide by zero, and a
# tiny one must not overflow the scale's reciprocal. vLLM uses the same floor (1 / (448 * 512)).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

Granularity = Literal["channel", "tensor"]
ActivationScheme = Literal["token", "tensor"]


@dataclass(frozen=True)
class Fp8Weight:
    q: torch.Tensor  # float8_e4m3fn [n, k]
    scales: torch.Tensor  # float32 [n] (per output channel) or [1] (per tensor)
    activations: ActivationScheme = "token"

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != FP8 or self.scales.dtype != torch.float32:
            raise ValueError("an FP8 weight is float8_e4m3fn values and float32 scales")
        if tuple(self.scales.shape) not in ((n,), (1,)):
            raise ValueError(f"scales {tuple(self.scales.shape)}: one per row of {n}, or one")
        if n % 16 or k % 16:  # what _scaled_mm's kernels take on a GPU
            raise ValueError(f"FP8 weights need both dimensions a multiple of 16, not [{n}, {k}]")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these stand for: q * scale (its row's, or the tensor's)."""
        return self.q.to(torch.float32) * self.scales.unsqueeze(-1)


def _quantize(values: torch.Tensor, amax: torch.Tensor, floor: float) -> tuple[torch.Tensor, ...]:
    """values / scale rounded to the nearest float8_e4m3fn, scale = amax / 448 (float32)."""
    scales = (amax.to(torch.float32) / FP8_MAX).clamp(min=floor)
    q = (values.to(torch.float32) / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


def quantize_weight(
    weight: torch.Tensor,
    granularity: Granularity = "channel",
    activations: ActivationScheme = "token",
) -> Fp8Weight:
    """A bf16/fp16/float32 weight [n, k] in FP8: each row's (or the tensor's) largest magnitude
    maps to 448. An all-zero row keeps scale 1 (any scale reproduces it)."""
    w = weight.detach().to(torch.float32)
    if granularity == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        amax = w.abs().amax().reshape(1, 1)
    amax = torch.where(amax > 0, amax, torch.full_like(amax, FP8_MAX))
    q, scales = _quantize(w, amax, 0.0)
    return Fp8Weight(q.contiguous(), scales.reshape(-1).contiguous(), activations)


def quantize_activations(
    x: torch.Tensor, scheme: ActivationScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] as FP8 and its float32 scales [m, 1] (per token) or [1, 1] (per tensor)."""
    if scheme == "token":
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        amax = x.abs().amax().reshape(1, 1)
    q, scales = _quantize(x, amax, MIN_SCALE)
    return q, scales


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] (bf16/fp16/float32) @ the FP8 weight.T (+ bias), in x's dtype. The sums are
    float32 over FP8 products; both scales multiply each sum once, in float32."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scales = quantize_activations(rows, weight.activations)
    n = weight.q.shape[0]
    w_t = weight.q.t()  # [k, n], column-major: the layout _scaled_mm wants its second operand in
    if x_scales.numel() == 1 and weight.scales.numel() == 1:
        scalar = (x_scales.reshape(()), weight.scales.reshape(()))
        out = torch._scaled_mm(xq, w_t, scale_a=scalar[0], scale_b=scalar[1], out_dtype=x.dtype)
    else:
        a_scale = x_scales.expand(rows.shape[0], 1).contiguous()
        b_scale = weight.scales.reshape(1, -1).expand(1, n).contiguous()
        if x.dtype == torch.bfloat16:  # row-wise scaling (sm89/sm90 CUTLASS): bf16 out only
            out = torch._scaled_mm(xq, w_t, scale_a=a_scale, scale_b=b_scale, out_dtype=x.dtype)
        else:  # the same float32 sums, scaled after: what row-wise scaling does inside
            one = torch.ones((), dtype=torch.float32, device=x.device)
            sums = torch._scaled_mm(xq, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)
            out = (sums * a_scale * b_scale).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*x.shape[:-1], n)
