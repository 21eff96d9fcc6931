"""Which slice of the model this rank holds, and the two collectives the sharded layers need.

With one rank every helper is the identity, so the single-device model runs exactly the code
(and the floating-point operations) it always did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import ModelLoadError


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1

    def split(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of `total` (heads, columns)."""
        count = total // self.size
        return self.rank * count, count

    def split_padded(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's share of `total` padded up to a multiple of the size
        (the vocabulary); the last ranks' shares may run past `total`."""
        count = -(-total // self.size)
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads. With more ranks than KV heads each rank holds
        one, replicated across the ranks whose query heads read it."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads)
        return self.rank // (self.size // num_kv_heads), 1


WHOLE = Shard()  # one process holds the whole model


def check_shardable(divisible: Iterable[tuple[str, int]], num_kv_heads: int, size: int) -> None:
    """Refuse, before anything starts, a rank count that does not divide the model: each of
    `divisible` (what, how many), and the KV heads unless the size is a multiple of them."""
    if size == 1:
        return
    problems = [f"the {count} {what}" for what, count in divisible if count % size]
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"the {num_kv_heads} KV heads (nor is it a multiple of them)")
    if problems:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} does not divide {' or '.join(problems)} of this model"
        )


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sum of every rank's partial result (row-parallel layers, the vocab-parallel embedding)."""
    if shard.size > 1:
        dist.all_reduce(x)
    return x


def gather_columns(x: torch.Tensor, shard: Shard, total: int) -> torch.Tensor | None:
    """Rank 0: every rank's column block side by side, cut to `total` columns; other ranks: None."""
    if shard.size == 1:
        return x
    if shard.rank == 0:
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :total]
    dist.gather(x, None, dst=0)
    return None
