"""The Llama family: Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3.

The differences are switches read from the Hugging Face config: q/k/v bias (Qwen2, or
`attention_bias`), per-head q/k RMSNorm (Qwen3), the RoPE variant, tied embeddings, sliding
windows (Mistral; Qwen2/3's `layer_types`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.models.base import DecoderModel
from engine.models.layers.attention import Attention, AttentionOptions, ForwardContext
from engine.models.layers.mlp import GatedMLP
from engine.models.layers.norm import RMSNorm

# Text models with q/k/v bias: Qwen2's, and Qwen2-VL's and Qwen2.5-VL's (Qwen2 with M-RoPE).
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")


def llama_attention(cfg: PretrainedConfig, model: DecoderModel, index: int) -> Attention:
    return model.attention(
        index,
        AttentionOptions(
            qkv_bias=cfg.model_type in QKV_BIAS_MODEL_TYPES
            or bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"),
            norm_eps=cfg.rms_norm_eps,
            sliding_window=model.info.sliding_windows[index],
        ),
    )


class PreNormLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)): the Llama-shaped decoder layer. The MLP may be
    any module taking (x, fused ops): a gated MLP or a mixture of experts."""

    def __init__(self, cfg: PretrainedConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out, residual = self.forward_carry(x, None, ctx)
        return residual + out

    def forward_carry(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual it is to be added to): the layer without its last
        add, which the next layer's input norm then does in its fused add + norm. `residual`
        None: `x` is the layer's whole input (the first layer's embeddings)."""
        if residual is None:
            h, residual = self.input_layernorm(x, ctx.fused), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, ctx.fused)
        attn = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(attn, residual, ctx.fused)
        return self.mlp(h, ctx.fused), residual


class LlamaForCausalLM(DecoderModel):
    def build_layer(self, index: int) -> nn.Module:
        cfg = self.config
        mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            getattr(cfg, "hidden_act", "silu"),
            bool(getattr(cfg, "mlp_bias", False)),
            self.shard,
        )
        return PreNormLayer(cfg, llama_attention(cfg, self, index), mlp)
