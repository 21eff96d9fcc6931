"""What the engine may know about a model: the `CausalLM` protocol a model object follows, and
`ArchitectureInfo`, what a model class reads off a Hugging Face config before any weight
exists (KV shapes, sliding windows, what tensor parallelism must divide)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PretrainedConfig

from engine.distributed.shard import Shard
from engine.models.layers.linear import CheckpointTensor
from kernels.attention import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class ArchitectureInfo:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]  # per layer; None: full attention
    # (what, how many): each must be divisible by the tensor-parallel size
    divisible: tuple[tuple[str, int], ...]
    # False when a forward reads values on the host (MoE routing): no CUDA graph capture
    graph_safe: bool = True
    # An encoder (BERT): attends both ways, keeps no KV cache, only pools (no LM head).
    encoder: bool = False
    # A mixture of experts: each expert multiplies the rows routed to it, a batch-dependent set.
    experts: bool = False


def text_config(cfg: PretrainedConfig) -> PretrainedConfig:
    """A vision-language config's text part (vocabulary, context, layers); a text model's
    config is its own."""
    return getattr(cfg, "text_config", None) or cfg


class CausalLM(Protocol):
    shard: Shard

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token of the flattened step."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the vocabulary; under tensor parallelism on rank 0 only (None on
        the others). Every rank must call it with the same number of rows."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None: ...

    def init_rotary(self, max_positions: int) -> None:
        """Built after the weights are in place (the module is created on the meta device)."""
        ...


class ModelClass(Protocol):
    """An architecture: built from its config and this rank's shard, described before it is."""

    def __call__(self, cfg: PretrainedConfig, shard: Shard) -> CausalLM: ...

    def describe(self, cfg: PretrainedConfig) -> ArchitectureInfo: ...
