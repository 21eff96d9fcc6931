"""The one step from what a loader holds to what a GPU linear runs on, and that linear.

A loader (GGUF, and checkpoints quantized by other tools) builds a QuantizedWeight on the CPU:
`to_gpu_weight` packs it for the Triton kernel (4- or 8-bit integers, float32 group scales and
mins) and moves it to the device. For --quantization fp8 it takes the bf16/fp16 weight itself
and quantizes it to FP8. `gpu_linear` runs either form."""

from __future__ import annotations

import torch

from kernels.cpu.quant_layout import QuantizedWeight
from kernels.gpu_quant.fp8 import ActivationScheme, Fp8Weight, Granularity, fp8_linear
from kernels.gpu_quant.fp8 import quantize_weight as quantize_fp8
from kernels.triton.quant_layout import PackedQuantWeight, pack, unfit

GpuWeight = Fp8Weight | PackedQuantWeight


def gpu_weight_unfit(weight: QuantizedWeight | torch.Tensor) -> str | None:
    """Why this weight has no GPU form, or None (a loader names the tensor with it)."""
    if isinstance(weight, QuantizedWeight):
        return unfit(weight)
    n, k = weight.shape
    if n % 16 or k % 16:
        return f"FP8 needs both dimensions a multiple of 16, not [{n}, {k}]"
    return None


def to_gpu_weight(
    weight: QuantizedWeight | torch.Tensor,
    device: torch.device | str,
    granularity: Granularity = "channel",
    activations: ActivationScheme = "token",
) -> GpuWeight:
    """A QuantizedWeight (any device) packed for the Triton kernel on `device`, or a float weight
    [n, k] quantized to FP8 there (quantizing on the GPU: a 7B model's weights in seconds).
    Raises ValueError saying why a weight does not fit (`gpu_weight_unfit`)."""
    why_not = gpu_weight_unfit(weight)
    if why_not is not None:
        raise ValueError(why_not)
    if isinstance(weight, QuantizedWeight):
        return pack(weight).to(device)
    return quantize_fp8(weight.to(device), granularity, activations)


def gpu_linear(x: torch.Tensor, weight: GpuWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] @ the de-quantized weight.T (+ bias), in x's dtype (bf16/fp16)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    # Imported here: Triton is installed with the GPU extra, and importing the engine must not
    # need it.
    from kernels.triton.quant_linear import quant_linear

    return quant_linear(x, weight, bias)
