"""Quantized weights on a GPU: after loading, every linear of a decoder gets its GPU form
(kernels/gpu_quant/weights.py) and drops its float copy.

- fp8: each bf16/fp16 weight quantized to float8_e4m3fn (a scale per output channel;
  activations per token at run time), the matmul through torch._scaled_mm.
- int8: each weight quantized to int8 with a scale per output row (as on the CPU), run as
  W8A16 by the Triton kernel.
- gguf, compressed-tensors, gptq, awq: the loader's integers (kernels/cpu/quant_layout's CPU
  layout) repacked for the Triton kernel, never widened to bf16. A checkpoint's FP8 weights come
  from its loader already as `Fp8Weight`s (its e4m3 bytes, engine/loading/fp8_layers.py) and
  are moved to the device unchanged (on a GPU below sm89 they were de-quantized and stay dense).

The head stays in the activations' dtype for fp8 and int8, as vLLM keeps it: the logits are
what sampling reads. A tied GGUF head runs on the embedding's de-quantized copy, which is
the same weight."""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.linear import PackableLinear, ParallelLMHead
from kernels.cpu.quant_layout import QuantizedWeight, quantize, unpack
from kernels.gpu_quant.fp8 import Fp8Weight
from kernels.gpu_quant.weights import gpu_weight_unfit, to_gpu_weight


def quantize_for_gpu(model: CausalLM, quantization: str, device: torch.device) -> int:
    """Give every linear its GPU form in place; the number of weights converted."""
    if not isinstance(model, DecoderModel):
        raise ModelLoadError(f"{quantization} weights are for decoder models")
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, PackableLinear):
            continue
        source: QuantizedWeight | torch.Tensor
        if isinstance(module.gpu_quantized, Fp8Weight):  # a checkpoint's FP8, as stored
            stored = module.gpu_quantized
            module.gpu_quantized = Fp8Weight(
                stored.q.to(device), stored.scales.to(device), stored.activations
            )
            count += 1
            continue
        if module.quantized is not None:  # a GGUF file's blocks
            source = unpack(module.quantized)
        elif module.weight is None or isinstance(module, ParallelLMHead):
            continue
        elif quantization == "fp8":
            source = module.weight.detach()
        elif quantization == "int8":
            source = quantize(module.weight)
        else:
            continue
        why_not = gpu_weight_unfit(source)
        if why_not is not None:
            raise ModelLoadError(f"{quantization} weights: {name}.weight: {why_not}")
        module.gpu_quantized = to_gpu_weight(source, device)
        module.quantized = module.quantized_bias = None
        module.register_parameter("weight", None)
        count += 1
    model.lm_head_quantized = None
    if device.type == "cuda":  # the float copies' memory, back for the KV pool to size into
        torch.cuda.empty_cache()
    return count
