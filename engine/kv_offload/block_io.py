"""Copies of whole KV blocks between the runner's paged cache and host tensors.

A block's contents are one tensor of shape (layers, 2, block_size, kv_heads, head_dim): every
layer's K and V. On the CPU they are plain copies (the tested path). On CUDA the host tensors
are pinned and both directions are asynchronous on the current stream: a load is ordered
before the step that reads it; a store's host tensor is ready once its event has completed,
which the disk writer waits for (a load back from the host tier is ordered after it on the
same stream). The CUDA path is checked by tests/gpu/test_gpu_kv_offload.py (passed on an H200);
its speed is not measured: each stored block takes a pinned allocation of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StoredBlocks:
    blocks: list[torch.Tensor]  # host tensors, one per block
    wait: Callable[[], None]  # returns once their contents are in place


def _ready() -> None:
    pass


class PoolBlockIO:
    def __init__(self, kv_caches: Callable[[], KVCaches]) -> None:
        # Read each time: the runner replaces its cache when the pool is (re)allocated.
        self._kv_caches = kv_caches

    def block_shape(self) -> tuple[int, ...]:
        caches = self._kv_caches()
        return (len(caches), 2, *caches[0][0].shape[1:])

    def dtype(self) -> torch.dtype:
        return self._kv_caches()[0][0].dtype

    def gather(self, block_ids: list[int]) -> StoredBlocks:
        """Copies of the blocks' contents, each a host tensor of its own."""
        caches = self._kv_caches()
        device = caches[0][0].device
        shape = self.block_shape()
        blocks = []
        for block_id in block_ids:
            stacked = torch.stack([part[block_id] for layer in caches for part in layer])
            stacked = stacked.view(shape)
            if device.type == "cpu":
                blocks.append(stacked)  # stack made it a tensor of its own already
                continue
            host = torch.empty(shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            blocks.append(host)
        if device.type == "cpu" or not blocks:
            return StoredBlocks(blocks, _ready)
        event = torch.cuda.Event()
        event.record()
        return StoredBlocks(blocks, event.synchronize)

    def scatter(self, block_ids: list[int], blocks: list[torch.Tensor]) -> None:
        """Write the contents into the pool's blocks (before any step reads them)."""
        if not block_ids:
            return
        caches = self._kv_caches()
        device = caches[0][0].device
        ids = torch.tensor(block_ids, device=device)
        # Each block copied on the stream, never read by the CPU: a block stored by the step
        # before may still be on its way into its pinned host tensor.
        staged = torch.stack([block.to(device, non_blocking=True) for block in blocks])
        for layer, (k, v) in enumerate(caches):
            k.index_copy_(0, ids, staged[:, layer, 0])
            v.index_copy_(0, ids, staged[:, layer, 1])
