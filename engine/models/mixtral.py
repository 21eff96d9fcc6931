"""Mixtral: a Llama-shaped model whose MLP is a sparse mixture of experts (top-k of
`num_local_experts`, softmax over all experts, the chosen weights renormalised to sum to one).
The checkpoint names experts `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down)."""

from __future__ import annotations

import re
from dataclasses import replace

from torch import nn
from transformers import PretrainedConfig

from engine.models.base import DecoderModel
from engine.models.interface import ArchitectureInfo
from engine.models.layers.moe import SparseMoE
from engine.models.llama import PreNormLayer, llama_attention

_EXPERT = re.compile(r"(layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_PART = {"w1": ("gate_up", "gate"), "w3": ("gate_up", "up"), "w2": ("down", "down")}


class MixtralForCausalLM(DecoderModel):
    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        info = super().describe(cfg)
        divisible = (
            ("attention heads", cfg.num_attention_heads),
            ("experts", cfg.num_local_experts),
        )
        return replace(info, divisible=divisible, graph_safe=False, experts=True)

    def build_layer(self, index: int) -> nn.Module:
        cfg = self.config
        moe = SparseMoE(
            cfg.hidden_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            cfg.intermediate_size,
            normalize=True,
            act=cfg.hidden_act,
            shard=self.shard,
        )
        return PreNormLayer(cfg, llama_attention(cfg, self, index), moe)

    def locate(self, name: str) -> tuple[str, str | None] | None:
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            layer, e, w = expert.groups()
            param, part = _PART[w]
            return f"{layer}.mlp.experts.{param}", f"{e}.{part}"
        return super().locate(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
