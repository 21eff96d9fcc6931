"""An EAGLE-3 head as vLLM loads it: one Llama decoder layer fed the token's embedding beside a
hidden state, over the paged K/V of its own single layer.

The folder's config.json is a LlamaConfig (architectures e.g. "LlamaForCausalLMEagle3") with
`draft_vocab_size` and, in `eagle_config`, the target layers whose inputs it reads
(`eagle_aux_hidden_state_layer_ids`; default 2, L // 2 and L - 3 of the target's L layers).
Its tensors: `fc.weight` [hidden, 3 * target hidden] (the three inputs side by side),
`midlayer.*` (the layer; q/k/v take 2 * hidden: the normed embedding, then the normed hidden
state, `midlayer.hidden_norm`), `norm.weight`, `lm_head.weight` [draft vocab, hidden],
`d2t` (a draft id plus its entry is the target id), maybe `t2d` (unused), maybe
`embed_tokens.weight` (else the target's embedding is shared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from engine.distributed.shard import WHOLE
from engine.errors import ModelLoadError
from engine.loading.hub import safetensors_files
from engine.loading.model_loader import iter_safetensors
from engine.models.base import FUSED_QKV_GATE_UP, head_dim_of
from engine.models.layers.attention import Attention, AttentionOptions, ForwardContext
from engine.models.layers.linear import CheckpointTensor, ColumnParallelLinear, Part
from engine.models.layers.mlp import GatedMLP
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.weights import load_checkpoint
from kernels.attention import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class Eagle3Settings:
    config: LlamaConfig
    aux_layers: tuple[int, ...]
    target_hidden_size: int
    draft_vocab_size: int

    @property
    def head_dim(self) -> int:
        return int(head_dim_of(self.config))

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads or self.config.num_attention_heads)


def read_settings(folder: Path, target_layers: int) -> Eagle3Settings:
    """The head's config (ModelLoadError when it is not an EAGLE-3 head's)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    if not any("eagle3" in a.lower() for a in raw.get("architectures") or []):
        raise ModelLoadError(f"{folder} is not an EAGLE-3 head (architectures: eagle3)")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    eagle = raw.get("eagle_config") or {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        layers = (2, target_layers // 2, target_layers - 3)
    return Eagle3Settings(
        config,
        tuple(int(i) for i in layers),
        int(raw.get("target_hidden_size") or config.hidden_size),
        int(raw.get("draft_vocab_size") or config.vocab_size),
    )


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # a buffer: draft id + d2t[draft id] is the target id

    def __init__(self, settings: Eagle3Settings) -> None:
        super().__init__()
        cfg = settings.config
        hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, settings.num_kv_heads
        head_dim = settings.head_dim
        self.settings = settings
        self.fc = nn.Linear(len(settings.aux_layers) * settings.target_hidden_size, hidden, False)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        # Some heads add the normed hidden state, not the raw one, after attention.
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        self.self_attn = Attention(
            hidden, heads, kv_heads, head_dim, 0, WHOLE, AttentionOptions(norm_eps=cfg.rms_norm_eps)
        )
        # Its q/k/v read the embedding and the hidden state side by side.
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn.qkv_proj = ColumnParallelLinear(
            2 * hidden,
            [
                Part("q", 0, heads * head_dim, heads * head_dim),
                Part("k", 0, kv_heads * head_dim, kv_heads * head_dim),
                Part("v", 0, kv_heads * head_dim, kv_heads * head_dim),
            ],
            bias,
        )
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        act = getattr(cfg, "hidden_act", "silu")
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, act, False, WHOLE)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, settings.draft_vocab_size, False)
        self.register_buffer("d2t", torch.zeros(settings.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None  # its own, when the folder has one
        self.rotary: RotaryEmbedding | None = None

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output, the output before the norm) of each row: the first gives the
        logits, the second is the next draft step's `hidden`."""
        assert self.rotary is not None, "init_rotary() before the first forward"
        ctx = ForwardContext(
            {"default": self.rotary.lookup(positions)}, backend, [kv_cache], meta, None
        )
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, ctx), residual)
        out = self.mlp(h) + residual
        return self.norm(out), out

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """The most likely token of each row, as a target id."""
        best = torch.argmax(self.lm_head(normed).float(), dim=-1)
        return best + self.d2t[best]

    def init_rotary(self, max_positions: int) -> None:
        weight = self.fc.weight
        params = rope_parameters(self.settings.config)
        self.rotary = RotaryEmbedding(
            self.settings.head_dim, max_positions, params, weight.device, weight.dtype
        )


def _locate(name: str) -> tuple[str, str | None] | None:
    """Our parameter (and part) for one of the folder's names; vLLM's loader reads the same."""
    name = name.removeprefix("model.")
    if name in ("d2t", "t2d"):  # d2t is a buffer, read apart; t2d is not used
        return None
    if name.startswith("midlayer."):
        module, _, param = name.removeprefix("midlayer.").rpartition(".")
        *outer, last = module.split(".")
        if last in FUSED_QKV_GATE_UP:
            ours, part = FUSED_QKV_GATE_UP[last]
            return ".".join([*outer, ours, param]), part
        return f"{module}.{param}", None
    return name, None


def load_head(
    folder: Path, settings: Eagle3Settings, target_embedding: torch.Tensor, dtype: torch.dtype
) -> Eagle3Head:
    """The head with the folder's weights, on the target's device in `dtype`; its embedding
    is the target's unless the folder has one. ModelLoadError for a tensor of the wrong
    shape, a missing one, or one with no place."""
    if not safetensors_files(folder):
        raise ModelLoadError(f"{folder} has no safetensors weights")
    tensors: list[tuple[str, CheckpointTensor]] = []
    own_embedding: CheckpointTensor | None = None
    for name, tensor in iter_safetensors(folder):
        if name.removeprefix("model.") == "embed_tokens.weight":
            own_embedding = tensor
        else:
            tensors.append((name, tensor))
    head = Eagle3Head(settings).to(device=target_embedding.device, dtype=dtype)
    with torch.no_grad():
        load_checkpoint(head, tensors, _locate)
        d2t = dict(tensors).get("d2t")
        if d2t is not None:
            head.d2t.copy_(d2t[:].to(torch.long))
        if own_embedding is not None:
            weight = own_embedding[:].to(device=target_embedding.device, dtype=dtype)
            head.embed_tokens = nn.Embedding.from_pretrained(weight)
    hidden = settings.config.hidden_size
    if own_embedding is None and target_embedding.shape[1] != hidden:
        raise ModelLoadError(
            f"the head's hidden size is {hidden}, the target's embedding "
            f"{target_embedding.shape[1]}: the head needs its own embed_tokens"
        )
    return head.eval()
