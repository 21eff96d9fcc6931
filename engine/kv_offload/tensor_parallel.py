"""The tiers under tensor parallelism: each rank keeps its own slice of every block (its KV
heads) in tiers of its own, and the ranks agree on how much of a prefix they hold.

Rank 0's scheduler asks, block by block, as with one rank; a block rank 0 finds is asked of
every worker too, and counts only when each of them finds its slice (a rank whose disk tier
turned off, or whose host tier evicted it, shortens the hit for all). A worker holds what it
found until rank 0 loads it: nothing evicts it in between. Loads and stores reach the workers
as messages on the same pipe as the steps, so each rank copies its slice in the order rank 0
did, between the same two steps.

Every rank stores the same blocks and loads the same hits, each slice the same size: the bytes,
usage and dropped blocks rank 0 reports are multiplied by the number of ranks."""

from __future__ import annotations

from dataclasses import fields
from typing import Protocol

import torch

from engine.kv_offload.block_io import PoolBlockIO
from engine.kv_offload.connector import FoundBlock, KVOffloadConnector
from engine.kv_offload.disk_tier import DiskTier
from engine.kv_offload.host_tier import HostTier
from engine.stats import KVOffloadStats

HASH_WORDS = 2  # a pool block hash is 16 bytes: two int64s in a message


class WorkerChannel(Protocol):
    @property
    def size(self) -> int:
        """Ranks, rank 0 among them."""

    def tell(self, kind: int, body: torch.Tensor) -> None:
        """Send a message to every worker."""

    def ask(self, kind: int, body: torch.Tensor) -> list[object]:
        """Send a message to every worker and return each one's answer."""


def pack_blocks(block_ids: list[int], hashes: list[bytes]) -> torch.Tensor:
    """[count, the block ids, the hashes as int64s]: a message body."""
    words = torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.int64)
    return torch.cat([torch.tensor([len(block_ids), *block_ids], dtype=torch.int64), words])


def unpack_blocks(body: torch.Tensor) -> tuple[list[int], list[bytes]]:
    count = int(body[0])
    block_ids = body[1 : 1 + count].tolist()
    raw = body[1 + count : 1 + count + HASH_WORDS * count].numpy().tobytes()
    size = HASH_WORDS * 8
    return block_ids, [raw[i * size : (i + 1) * size] for i in range(count)]


# Message kinds, after the executor's own (engine/worker/tp_worker.py).
FIND, LOAD, STORE = 5, 6, 7


class RankTiers:
    """A worker's side: its own tiers over its own slice of the pool."""

    def __init__(self, connector: KVOffloadConnector) -> None:
        self.connector = connector
        self._found: dict[bytes, FoundBlock] = {}  # found for rank 0's lookup, until loaded

    def handle(self, kind: int, body: torch.Tensor) -> bool | None:
        """Run one message; FIND is answered (whether this rank holds the block)."""
        block_ids, hashes = unpack_blocks(body)
        if kind == FIND:
            found = self.connector.find(hashes[0])
            if found is not None:
                self._found[hashes[0]] = found
            return found is not None
        if kind == LOAD:
            missing = [h.hex() for h in hashes if h not in self._found]
            if missing:  # rank 0 loads only what every rank found: a broken protocol, not a miss
                raise RuntimeError(f"asked to load blocks this rank did not find: {missing}")
            self.connector.load([self._found[h] for h in hashes], block_ids)
        else:
            self.connector.store(list(zip(block_ids, hashes)))
        self._found.clear()  # what a lookup found and did not load is not held past it
        return None

    def close(self) -> None:
        self.connector.close()


class TensorParallelTiers(KVOffloadConnector):
    """Rank 0's side: its own tiers, and the workers asked and told over `channel`."""

    def __init__(
        self,
        identity: bytes,
        io: PoolBlockIO,
        host: HostTier | None,
        disk: DiskTier | None,
        channel: WorkerChannel,
    ) -> None:
        super().__init__(identity, io, host, disk)
        self.channel = channel

    def find(self, block_hash: bytes) -> FoundBlock | None:
        found = super().find(block_hash)
        if found is None:
            return None
        answers = self.channel.ask(FIND, pack_blocks([0], [block_hash]))
        return found if all(answers) else None

    def load(self, found: list[FoundBlock], block_ids: list[int]) -> None:
        super().load(found, block_ids)
        self.channel.tell(LOAD, pack_blocks(block_ids, [f.block_hash for f in found]))

    def store(self, blocks: list[tuple[int, bytes]]) -> None:
        super().store(blocks)
        if blocks:
            block_ids = [block_id for block_id, _ in blocks]
            self.channel.tell(STORE, pack_blocks(block_ids, [h for _, h in blocks]))

    def take_stats(self) -> KVOffloadStats:
        stats = super().take_stats()
        ranks = self.channel.size
        for field in fields(stats):
            per_tier: dict[str, int] = getattr(stats, field.name)
            for tier in per_tier:
                per_tier[tier] *= ranks
        return stats
