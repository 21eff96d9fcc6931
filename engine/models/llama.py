"""One implementation for the Llama family: Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3.

The differences are switches read from the Hugging Face config: q/k/v bias (Qwen2, or
`attention_bias`), per-head q/k RMSNorm (Qwen3), the RoPE variant, tied embeddings. The model
works on one flattened varlen batch (no padding, no batch dimension); attention reads and writes
the paged KV cache through the backend.

Under tensor parallelism (`Shard`) each rank builds the same model with its slice of every
layer: q/k/v by heads and gate/up by columns (column-parallel, no communication), o and down
by rows (row-parallel, then an all-reduce), the embedding and LM head by vocabulary (an
all-reduce after the lookup, the logits gathered on rank 0). `load_weights` reads only this
rank's slices from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from engine.parallel.shard import WHOLE, Shard, all_reduce, gather_columns
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu.packed_linear import can_pack, linear, pack


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, fused: ModuleType | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x)."""
        if fused is not None:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


class Linear(nn.Linear):
    """nn.Linear that runs on its prepacked CPU weight once `pack_weights` has made one."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across ranks: each rank's product is a
    partial sum, added up by an all-reduce; the bias is added once, after it."""

    packed: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return linear(x, self.weight, self.packed, self.bias)
        y = all_reduce(linear(x, self.weight, self.packed, None), self.shard)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous block of vocabulary rows (padded with zero rows so that
    the blocks are equal); a token outside this rank's block contributes zeros to the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.vocab_start, self.rows = shard.split_padded(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(
            self.weight.dtype
        )
        return all_reduce(x, self.shard)


class Attention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, shard: Shard) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(cfg)
        self.q_head0, self.num_heads = shard.split(cfg.num_attention_heads)
        self.kv_head0, self.num_kv_heads = shard.kv_heads(cfg.num_key_value_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(
            self.q_size, cfg.hidden_size, bool(getattr(cfg, "attention_bias", False)), shard
        )
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.fused is not None:  # in place, on the qkv output (or the normed copies)
            cos, sin = ctx.cos[:, 0], ctx.sin[:, 0]
            ctx.fused.rotary_(q, cos, sin)
            ctx.fused.rotary_(k, cos, sin)
        else:
            q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, shard: Shard) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: silu")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.column0, self.intermediate = shard.split(cfg.intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = RowParallelLinear(self.intermediate, cfg.hidden_size, bias, shard)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_idx: int, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x, ctx.fused), ctx)
        h, x = self.post_attention_layernorm.add_forward(attn, x, ctx.fused)
        return x + self.mlp(h, ctx.fused)


class ForwardContext:
    """What every layer needs for one step besides its input."""

    def __init__(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        fused: ModuleType | None,
    ) -> None:
        self.cos, self.sin = cos_sin
        self.backend = backend
        self.kv_caches = kv_caches
        self.meta = meta
        self.fused = fused  # kernels.cpu.fused_ops once `fuse_cpu_ops` has loaded it, else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: PretrainedConfig, shard: Shard = WHOLE) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, shard) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, self.embed_tokens.rows, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.lm_head_packed: torch.Tensor | None = None
        self.fused_ops: ModuleType | None = None

    @property
    def layer0(self) -> DecoderLayer:
        """The first layer: every layer's shapes (this rank's heads and columns) are the same."""
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (what one layer's KV cache is sized for)."""
        return self.layer0.self_attn.num_kv_heads

    def pack_weights(self) -> bool:
        """Prepack every linear weight for oneDNN (CPU, bfloat16), after loading; the unpacked
        copies are dropped, but the embedding's, which the lookup still reads. False if the
        weights cannot be packed here."""
        if not can_pack(self.embed_tokens.weight):
            return False
        head = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        self.lm_head_packed = pack(head)
        if not self.tie_word_embeddings:
            self.lm_head.register_parameter("weight", None)
        for module in self.modules():
            if isinstance(module, (Linear, RowParallelLinear)) and module.weight is not None:
                module.packed = pack(module.weight)
                module.register_parameter("weight", None)
        return True

    def fuse_cpu_ops(self) -> str | None:
        """Run the norms, residual adds, rotary and SiLU-mul through kernels/cpu/fused_ops (built
        on first use). None when done, else why not: the layers then keep their torch ops."""
        if self.embed_tokens.weight.device.type != "cpu":
            return "not on the CPU"
        try:
            from kernels.cpu import fused_ops
        except (
            ImportError,
            OSError,
            RuntimeError,
        ) as exc:  # no compiler or ninja: the build failed
            return f"kernels.cpu.fused_ops could not be built: {exc}"
        self.fused_ops = fused_ops
        return None

    def init_rotary(self, max_positions: int) -> None:
        """Built after the weights are in place (the module is created on the meta device)."""
        weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            head_dim_of(self.config),
            max_positions,
            rope_parameters(self.config),
            weight.device,
            weight.dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.rotary is None:
            raise RuntimeError("init_rotary() must run before the first forward")
        ctx = ForwardContext(
            self.rotary.lookup(positions), backend, kv_caches, meta, self.fused_ops
        )
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x, self.fused_ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the vocabulary; under tensor parallelism on rank 0 only (None on
        the others). Every rank must call it with the same number of rows."""
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = linear(hidden, weight, self.lm_head_packed, None)
        return gather_columns(logits.float(), self.shard, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up and reading only this
        rank's slice of each; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        if self.embed_tokens.vocab_start + self.embed_tokens.rows > self.config.vocab_size:
            # The last ranks' padding rows: never read from the checkpoint, they must be zeros.
            for name in ("embed_tokens.weight", "lm_head.weight"):
                if name in params:
                    params[name].data.zero_()
        for hf_name, source in weights:
            target = _map_name(hf_name)
            if target is None or (target[0] == "lm_head.weight" and self.tie_word_embeddings):
                continue
            name, offset_of = target
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
            param = params[name]
            tensor = self._read_slice(name, offset_of, source)
            rows = slice(None)
            if offset_of is not None:
                start = self._fused_offset(name, offset_of)
                rows = slice(start, start + tensor.shape[0])
            elif name in ("embed_tokens.weight", "lm_head.weight"):
                rows = slice(0, tensor.shape[0])  # the rest is padding
            with torch.no_grad():
                dst = param.data[rows]
                if dst.shape != tensor.shape:
                    raise ModelLoadError(
                        f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            loaded.add(f"{name}:{offset_of}")
        expected = {f"{n}:{part}" for n in params for part in _fused_parts(n)}
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}"
            )

    def _read_slice(self, name: str, part: str | None, source: CheckpointTensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor: (dim, first, count) by the layer it feeds."""
        if self.shard.size == 1:
            return source[:]
        attn, mlp = self.layer0.self_attn, self.layer0.mlp
        d = attn.head_dim
        if part == "q":
            dim, first, count = 0, attn.q_head0 * d, attn.q_size
        elif part in ("k", "v"):
            dim, first, count = 0, attn.kv_head0 * d, attn.kv_size
        elif part in ("gate", "up"):
            dim, first, count = 0, mlp.column0, mlp.intermediate
        elif name.endswith("o_proj.weight"):
            dim, first, count = 1, attn.q_head0 * d, attn.q_size
        elif name.endswith("down_proj.weight"):
            dim, first, count = 1, mlp.column0, mlp.intermediate
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            vocab = self.config.vocab_size
            first = min(self.embed_tokens.vocab_start, vocab)
            dim, count = 0, min(self.embed_tokens.rows, vocab - first)
        else:  # norms, row-parallel biases: every rank holds them whole
            return source[:]
        return source[first : first + count] if dim == 0 else source[:, first : first + count]

    def _fused_offset(self, name: str, part: str) -> int:
        attn, mlp = self.layer0.self_attn, self.layer0.mlp
        return {
            "q": 0,
            "k": attn.q_size,
            "v": attn.q_size + attn.kv_size,
            "gate": 0,
            "up": mlp.intermediate,
        }[part]


class CheckpointTensor(Protocol):
    """A tensor, or safetensors' lazy slice of one: indexing reads only the indexed part."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def head_dim_of(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_name(hf_name: str) -> tuple[str, str | None] | None:
    """HF tensor name -> (our parameter name, fused part or None); None for tensors we skip."""
    if "rotary_emb" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, piece = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), piece
    return name, None


def _fused_parts(param_name: str) -> list[str | None]:
    if ".qkv_proj." in param_name:
        return ["q", "k", "v"]
    if ".gate_up_proj." in param_name:
        return ["gate", "up"]
    return [None]
