"""Gemma 2: sandwich norms around attention and MLP (pre and post, in Gemma's (1 + w) form),
embeddings scaled by sqrt(hidden_size), a GELU-tanh MLP, attention scaled by
`query_pre_attn_scalar` with its logits soft-capped, sliding-window layers alternating with
global ones (`layer_types`), and soft-capped final logits."""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.models.base import DecoderModel
from engine.models.layers.attention import Attention, AttentionOptions, ForwardContext
from engine.models.layers.mlp import GatedMLP
from engine.models.layers.norm import RMSNorm


class SandwichLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    def __init__(self, cfg: PretrainedConfig, attn: Attention, mlp: GatedMLP) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, gemma=True)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(dim, eps, gemma=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(dim, eps, gemma=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx.fused)
        return x + self.post_feedforward_layernorm(h)


def gemma_attention(
    model: DecoderModel, index: int, *, qk_norm: bool, rope: str = "default"
) -> Attention:
    cfg = model.config
    return model.attention(
        index,
        AttentionOptions(
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm=qk_norm,
            gemma_norm=True,
            norm_eps=cfg.rms_norm_eps,
            scale=cfg.query_pre_attn_scalar**-0.5,
            sliding_window=model.info.sliding_windows[index],
            softcap=getattr(cfg, "attn_logit_softcapping", None),
            rope=rope,
        ),
    )


def gemma_mlp(model: DecoderModel) -> GatedMLP:
    cfg = model.config
    return GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, False, model.shard
    )


class Gemma2ForCausalLM(DecoderModel):
    gemma_norm = True

    def build_layer(self, index: int) -> nn.Module:
        attn = gemma_attention(self, index, qk_norm=False)
        return SandwichLayer(self.config, attn, gemma_mlp(self))

    def embedding_scale(self) -> float | None:
        return math.sqrt(self.config.hidden_size)

    def final_softcap(self) -> float | None:
        return getattr(self.config, "final_logit_softcapping", None)
