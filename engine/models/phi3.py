"""Phi-3: a Llama-shaped model whose checkpoint already fuses q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`): each rank reads its rows of every part out of the fused tensor. LongRoPE
comes from the rotary toolkit; every layer uses the config's sliding window, if any."""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.models.interface import ArchitectureInfo
from engine.models.layers.rotary import rope_parameters
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {}  # the checkpoint fuses them

    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        if rope_parameters(cfg).get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError("Phi-3 with partial_rotary_factor below 1 is not supported")
        return super().describe(cfg)
