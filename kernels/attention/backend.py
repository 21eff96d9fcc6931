"""The contract between the model and an attention backend.

The KV cache of one layer is a pair of tensors shaped `[num_blocks, block_size, num_kv_heads,
head_dim]` (the layout flash-attn's paged kernels read). A step is one flattened varlen batch:
request i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, whose tokens sit at the last
positions of its `seqlens_k[i]` tokens of context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: skip)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqlens_k: torch.Tensor  # [num_reqs] int32, context length including the new tokens
    # Host copies: the torch backend plans its work from them without a device sync.
    query_lens: list[int]
    context_lens: list[int]
    # Whatever a backend derives from this metadata once per step and reuses in every layer.
    backend_plan: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    name: str
    # True when an all-decode step reads no host metadata but `query_lens`, so that a CUDA
    # graph captured once replays correctly for any context lengths.
    graph_safe: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new K/V through `slot_mapping`, then attend causally through the block table."""
        ...
