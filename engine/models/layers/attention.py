"""Self-attention over the paged KV cache: fused q/k/v projection, optional per-head q/k
norms, rotary embeddings, the attention backend, the output projection. Heads are split across
tensor-parallel ranks (KV heads replicated when there are more ranks than KV heads)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from engine.distributed.shard import Shard
from engine.models.layers.linear import ColumnParallelLinear, Part, RowParallelLinear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import apply_rotary
from kernels.attention import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """What every layer needs for one step besides its input."""

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # cos, sin [T, 1, dim] per rotary table
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    fused: ModuleType | None  # the fused elementwise ops the model was given, else None


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between architectures' attention layers."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    gemma_norm: bool = False  # that norm in Gemma's (1 + w) form
    norm_eps: float = 1e-6
    scale: float | None = None  # None: head_dim ** -0.5
    sliding_window: int | None = None
    softcap: float | None = None
    rope: str = "default"  # which of the model's rotary tables this layer reads


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        shard: Shard,
        options: AttentionOptions,
    ) -> None:
        super().__init__()
        self.layer_idx, self.head_dim, self.options = layer_idx, head_dim, options
        q_head0, self.num_heads = shard.split(num_heads)
        kv_head0, self.num_kv_heads = shard.kv_heads(num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_total, kv_total = num_heads * head_dim, num_kv_heads * head_dim
        # Offsets: where k and v start in a checkpoint that fuses q, k and v (Phi-3).
        self.qkv_proj = ColumnParallelLinear(
            hidden_size,
            [
                Part("q", q_head0 * head_dim, self.q_size, q_total),
                Part("k", kv_head0 * head_dim, self.kv_size, kv_total, offset=q_total),
                Part("v", kv_head0 * head_dim, self.kv_size, kv_total, offset=q_total + kv_total),
            ],
            options.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            q_head0 * head_dim, self.q_size, hidden_size, options.o_bias, shard
        )
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, options.norm_eps, gemma=options.gemma_norm)
            self.k_norm = RMSNorm(head_dim, options.norm_eps, gemma=options.gemma_norm)
        self.scale = options.scale if options.scale is not None else head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cos, sin = ctx.rope[self.options.rope]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        # The GPU's fused ops (kernels/triton/fused_ops) norm, rotate and store K/V in one kernel.
        kv_stored = hasattr(ctx.fused, "rope_store_kv")
        if kv_stored:
            assert ctx.fused is not None
            norm_weights = None
            if self.options.qk_norm and self.options.gemma_norm:  # (1 + w), in float32: torch
                q, k = self.q_norm(q), self.k_norm(k)
            elif self.options.qk_norm:
                norm_weights = (self.q_norm.weight, self.k_norm.weight)
            q = ctx.fused.rope_store_kv(
                q,
                k,
                v,
                cos[:, 0],
                sin[:, 0],
                k_cache,
                v_cache,
                ctx.meta.slot_mapping,
                norm_weights,
                self.options.norm_eps,
            )
        else:
            if self.options.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if ctx.fused is not None:  # in place, on the qkv output (or the normed copies)
                ctx.fused.rotary_(q, cos[:, 0], sin[:, 0])
                ctx.fused.rotary_(k, cos[:, 0], sin[:, 0])
            else:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.backend.forward(
            q,
            k,
            v,
            k_cache,
            v_cache,
            ctx.meta,
            self.scale,
            sliding_window=self.options.sliding_window,
            softcap=self.options.softcap,
            kv_stored=kv_stored,
        )
        return self.o_proj(out.reshape(-1, self.q_size))
