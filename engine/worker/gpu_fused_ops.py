"""Gives a decoder on a CUDA GPU the fused Triton kernels (kernels/triton/fused_ops.py) as its
`fused_ops`: the layers then run their norms, residual adds, q/k norms + rotary + K/V store and
SiLU-mul as one kernel each instead of several torch ones (--no-fused-kernels: not given).
Pre-norm layers (the Llama family, Mixtral, Qwen3-MoE) also hand their last residual add to the
next layer's input norm, which does it in its fused add + norm: one kernel less a layer."""

from __future__ import annotations

from types import ModuleType

import torch

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.attention import ForwardContext
from engine.models.llama import PreNormLayer


class CarriedResidualLayers:
    """The model's `layers_runner`: its pre-norm layers in order, each one's residual add left
    to the next one's norm; what the plain loop computes, rounded at the same points."""

    def __init__(self, layers: list[PreNormLayer]) -> None:
        self.layers = layers

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            x, residual = layer.forward_carry(x, residual, ctx)
        assert residual is not None, "a model without layers"
        return residual + x


def give_fused_ops(model: DecoderModel, ops: ModuleType) -> None:
    """`ops` as the model's fused ops, and the carried residual where every layer is pre-norm."""
    model.fused_ops = ops
    layers = [layer for layer in model.layers if isinstance(layer, PreNormLayer)]
    if len(layers) == len(model.layers):
        model.layers_runner = CarriedResidualLayers(layers)


def use_triton_fused_ops(model: CausalLM) -> str | None:
    """None when given, else why not: the layers then keep their torch ops."""
    if not isinstance(model, DecoderModel):
        return "not a decoder model"
    if model.embed_tokens.weight.device.type != "cuda":
        return "not on a CUDA device"
    try:
        from kernels.triton import fused_ops
    except ImportError as exc:  # triton missing or broken
        return f"kernels.triton.fused_ops does not load: {exc}"
    give_fused_ops(model, fused_ops)
    return None
