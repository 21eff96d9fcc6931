"""Gemma 3 (text): Gemma 2's layer with per-head q/k norms, five sliding-window layers to each
global one (`layer_types`), and a rotary table per kind of layer (the local layers' own base
frequency); no attention soft-capping unless the config sets it."""

from __future__ import annotations

from torch import nn

from engine.models.gemma2 import Gemma2ForCausalLM, SandwichLayer, gemma_attention, gemma_mlp
from engine.models.layers.rotary import rope_parameters

# layer type -> the rotary table its layers read
_ROPE = {"sliding_attention": "local", "full_attention": "global"}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def build_layer(self, index: int) -> nn.Module:
        rope = _ROPE[self.config.layer_types[index]]
        attn = gemma_attention(self, index, qk_norm=True, rope=rope)
        return SandwichLayer(self.config, attn, gemma_mlp(self))

    def rope_settings(self) -> dict[str, dict]:
        return {name: rope_parameters(self.config, kind) for kind, name in _ROPE.items()}
