"""The reduction of a step's hidden states to one vector per sequence, done on the device in
a few batched ops (no loop over sequences on the host)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.pooling.spec import PoolerSpec


def pool(hidden: torch.Tensor, lens: list[int], spec: PoolerSpec) -> torch.Tensor:
    """hidden: [tokens, H], the sequences' rows one after another (`lens` each); returns
    [sequences, H] in float32, L2-normalized when the spec says so."""
    device = hidden.device
    lengths = torch.tensor(lens, device=device)
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    h = hidden.float()
    if spec.pooling_type == "cls":
        pooled = h.index_select(0, starts)
    elif spec.pooling_type == "last":
        pooled = h.index_select(0, ends - 1)
    else:
        owner = torch.repeat_interleave(torch.arange(len(lens), device=device), lengths)
        sums = torch.zeros(len(lens), h.shape[1], dtype=h.dtype, device=device)
        sums.index_add_(0, owner, h)
        pooled = sums / lengths[:, None].to(h.dtype)
    if spec.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled
