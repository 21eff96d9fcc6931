"""--quantization int8: every linear weight of a loaded model (the tied head too) quantized to
int8 with one float32 scale per output row, for kernels/cpu/quant_linear; the embedding lookup
keeps the weight as loaded. Decode reads each weight once a step: int8 is half bf16's bytes."""

from __future__ import annotations

import torch

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.linear import PackableLinear
from kernels.cpu.quant_layout import pack, quantize


def quantize_int8(model: CausalLM) -> int:
    """Quantize in place; the number of weights quantized. The bf16/float32 copies are dropped."""
    if not isinstance(model, DecoderModel):
        raise ValueError("--quantization int8 is for decoder models")
    count = 0
    for module in model.modules():
        if not isinstance(module, PackableLinear) or module.weight is None:
            continue
        module.quantized = pack(quantize(module.weight))
        if module.bias is not None:
            module.quantized_bias = module.bias.detach().to(torch.float32).contiguous()
        module.register_parameter("weight", None)
        count += 1
    if model.tie_word_embeddings:
        model.lm_head_quantized = pack(quantize(model.embed_tokens.weight))
        count += 1
    return count
