"""The contract between the model and an attention backend.

The KV cache of one layer is a pair of tensors shaped `[num_blocks, block_size, num_kv_heads,
head_dim]` (the layout flash-attn's paged kernels read). A step is one flattened varlen batch:
request i owns query rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, whose tokens sit at the last
positions of its `seqlens_k[i]` tokens of context.

Attention is causal, and two per-layer options shape it, with Hugging Face transformers'
semantics (Gemma 2/3, Mistral):

- `sliding_window=W`: a query at position p sees only the W keys at positions p-W+1 .. p
  (itself included; transformers masks `kv_idx > q_idx - sliding_window`, flash-attn calls
  this `window_size=(W - 1, 0)`). None: every key up to p.
- `softcap=c`: the scaled scores s become `c * tanh(s / c)` before masking and the softmax
  (Gemma 2's `attn_logit_softcapping`). None: scores as they are.

Layers of one model differ in these (Gemma alternates windowed and global layers) within one
step, so whatever a backend plans once per step on `meta.backend_plan` must not be shared by
layers that need different plans.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

_Plan = TypeVar("_Plan")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: skip)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32
    seqlens_k: torch.Tensor  # [num_reqs] int32, context length including the new tokens
    # Host copies: the torch backend plans its work from them without a device sync.
    query_lens: list[int]
    context_lens: list[int]
    # What a backend derives from this metadata once per step and reuses in every layer that
    # needs the same (see `planned`), by key.
    backend_plan: dict[Hashable, Any] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def planned(self, key: Hashable, make: Callable[[], _Plan]) -> _Plan:
        """What `make` derives from this step's metadata for the layers of kind `key` (e.g.
        their sliding window): made by the first such layer of the step, reused by the rest, and
        never handed to a layer of another kind."""
        if self.backend_plan is None:
            self.backend_plan = {}
        if key not in self.backend_plan:
            self.backend_plan[key] = make()
        plan: _Plan = self.backend_plan[key]
        return plan


def check_window_and_softcap(sliding_window: int | None, softcap: float | None) -> None:
    """Reject the values that have no meaning (a window of no key, a cap of zero or less), which
    the kernels would otherwise read as 'none' or turn into NaNs."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")


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
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new K/V through `slot_mapping` (unless `kv_stored`: the caller's fused
        kernel stored them, and k, v are not read), then attend causally through the block
        table, within `sliding_window` keys and with scores capped by `softcap` when given."""
        ...
