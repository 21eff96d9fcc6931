"""All decoder layers of a Llama-shaped model in one C++ call (layer_stack.cpp, built with
the package). It calls the fused ops and the attention kernels as torch
operators, so their modules are loaded first."""

from __future__ import annotations

# They register the operators.
from kernels.cpu import (  # noqa: F401
    bf16_linear,
    fused_ops,
    paged_attention_op,
    prefill_attention_op,
    quant_linear,
)
from kernels.cpu.extension import load

LayerStack = load("layer_stack").LayerStack

# The tensors that describe one layer, in the order the C++ constructor reads them (None where a
# layer has no such tensor: a bias, a q/k norm, a weight that was prepacked or not; the scales
# and mins of a quantized weight, whose `packed` is then its integers).
LAYER_TENSORS = (
    "input_norm",
    "qkv_weight",
    "qkv_packed",
    "qkv_scales",
    "qkv_mins",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o_weight",
    "o_packed",
    "o_scales",
    "o_mins",
    "o_bias",
    "post_norm",
    "gate_up_weight",
    "gate_up_packed",
    "gate_up_scales",
    "gate_up_mins",
    "gate_up_bias",
    "down_weight",
    "down_packed",
    "down_scales",
    "down_mins",
    "down_bias",
)
