"""BERT, the encoder of sentence-transformers checkpoints (all-MiniLM-L6-v2 and kin).

Unlike the decoders here it attends both ways within each sequence, adds learned absolute
position and token-type embeddings, normalizes after each residual add (post-LN) and uses GELU.
It keeps no KV cache: a sequence runs whole in one step, so the cache arguments of `forward`
are accepted (the runner passes them to every model) and unused. Parameter names are the
checkpoint's own, so loading is a copy by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from engine.distributed.shard import WHOLE, Shard
from engine.errors import ModelLoadError
from engine.models.interface import ArchitectureInfo
from engine.models.layers.linear import CheckpointTensor
from engine.models.weights import load_checkpoint
from kernels.attention import AttentionBackend, AttentionMetadata


class _Padding:
    """The flat varlen rows of a step laid out as a padded [sequences, longest] batch, once per
    forward: every layer's attention reuses it."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.lens = lens
        self.width = max(lens)
        self.uniform = all(n == self.width for n in lens)
        if self.uniform:
            self.rows = None
            self.key_mask = None
            return
        self.rows = torch.cat(
            [torch.arange(n, device=device) + i * self.width for i, n in enumerate(lens)]
        )
        cols = torch.arange(self.width, device=device)
        lengths = torch.tensor(lens, device=device)
        # [sequences, 1, 1, keys]: a query attends to its own sequence's real tokens only.
        self.key_mask = (cols[None, :] < lengths[:, None])[:, None, None, :]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [sequences, width, ...]; padded rows are zero."""
        if self.rows is None:
            return x.view(len(self.lens), self.width, *x.shape[1:])
        out = x.new_zeros(len(self.lens) * self.width, *x.shape[1:])
        out.index_copy_(0, self.rows, x)
        return out.view(len(self.lens), self.width, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(len(self.lens) * self.width, *x.shape[2:])
        return flat if self.rows is None else flat.index_select(0, self.rows)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, padding: _Padding) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, H*D] -> [B, H, L, D]
            return padding.pad(t).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding.key_mask)
        return padding.unpad(out.transpose(1, 2).flatten(-2))


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, padding: _Padding) -> torch.Tensor:
        return self.output(self.self(x, padding), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, padding: _Padding) -> torch.Tensor:
        x = self.attention(x, padding)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # One segment per input: every token is of type 0, whose row is added to all.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertModel(nn.Module):
    def __init__(self, cfg: PretrainedConfig, shard: Shard = WHOLE) -> None:
        super().__init__()
        if shard.size > 1:
            raise ModelLoadError("BertModel runs on one device: no tensor parallelism")
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"BertModel with position_embedding_type {cfg.position_embedding_type!r} is not "
                "supported (only absolute)"
            )
        self.config, self.shard = cfg, shard
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        heads = cfg.num_attention_heads
        return ArchitectureInfo(
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=cfg.hidden_size // heads,
            sliding_windows=(None,) * cfg.num_hidden_layers,
            divisible=(("attention heads", heads),),
            encoder=True,
        )

    def init_rotary(self, max_positions: int) -> None:
        """Nothing to build: positions are learned embeddings."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        padding = _Padding(list(meta.query_lens), input_ids.device)
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, padding)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError("an encoder has no language-model head: it only pools")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_checkpoint(self, weights, self._locate)

    def _locate(self, hf_name: str) -> tuple[str, str | None] | None:
        # A BertForXxx checkpoint prefixes the encoder with "bert."; the pooler's dense layer
        # (next-sentence head) and the position-id buffer are not used for embeddings.
        name = hf_name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            return None
        return name, None
