"""The host-memory tier: block contents by key, least recently used out first, bounded by
bytes. Each entry is a tensor of its own (never a view of a larger one), so evicting it gives
its memory back. On CUDA the connector hands it pinned tensors (copied asynchronously)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes) -> torch.Tensor | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, key: bytes, block: torch.Tensor) -> list[bytes] | None:
        """Keep `block` (the caller's own tensor), evicting the oldest to make room: the keys
        evicted, or None when it was not kept (held already, or larger than the tier)."""
        size = block.numel() * block.element_size()
        if key in self._blocks or size > self.capacity_bytes:
            return None
        evicted = []
        while self.used_bytes + size > self.capacity_bytes:
            old_key, old = self._blocks.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
            evicted.append(old_key)
        self._blocks[key] = block
        self.used_bytes += size
        return evicted
