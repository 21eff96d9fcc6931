"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse mixture-of-experts MLPs (top-k
of `num_experts`, renormalised only with `norm_topk_prob`); layers listed in `mlp_only_layers`,
or off the `decoder_sparse_step` stride, keep a dense MLP. The checkpoint names experts
`mlp.experts.{e}.gate_proj/up_proj/down_proj`."""

from __future__ import annotations

import re
from dataclasses import replace

from torch import nn
from transformers import PretrainedConfig

from engine.models.base import DecoderModel
from engine.models.interface import ArchitectureInfo
from engine.models.layers.mlp import GatedMLP
from engine.models.layers.moe import SparseMoE
from engine.models.llama import PreNormLayer, llama_attention

_EXPERT = re.compile(r"(layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def is_sparse(cfg: PretrainedConfig, index: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    only_dense = getattr(cfg, "mlp_only_layers", None) or []
    return index not in only_dense and cfg.num_experts > 0 and (index + 1) % step == 0


class Qwen3MoeForCausalLM(DecoderModel):
    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        info = super().describe(cfg)
        divisible = [("attention heads", cfg.num_attention_heads), ("experts", cfg.num_experts)]
        if not all(is_sparse(cfg, i) for i in range(cfg.num_hidden_layers)):
            divisible.append(("MLP columns", cfg.intermediate_size))
        return replace(info, divisible=tuple(divisible), graph_safe=False, experts=True)

    def build_layer(self, index: int) -> nn.Module:
        cfg = self.config
        mlp: nn.Module
        if is_sparse(cfg, index):
            mlp = SparseMoE(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                normalize=bool(cfg.norm_topk_prob),
                act=cfg.hidden_act,
                shard=self.shard,
            )
        else:
            mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.shard
            )
        return PreNormLayer(cfg, llama_attention(cfg, self, index), mlp)

    def locate(self, name: str) -> tuple[str, str | None] | None:
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            layer, e, part = expert.groups()
            param = "down" if part == "down" else "gate_up"
            return f"{layer}.mlp.experts.{param}", f"{e}.{part}"
        return super().locate(name)
