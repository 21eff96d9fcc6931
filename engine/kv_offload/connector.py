"""What the KV cache manager asks of the tiers: find a block by its pool hash, copy found
blocks into pool blocks, and store the blocks a step has just written.

Stores are write-through: the blocks each step newly registers are copied out of the pool
right after that step's forward pass (a copy per block, on the engine thread: the pool block
may be reused by the very next step), into the host tier and onto the disk writer's queue.
Eviction from the pool then costs nothing. A block already in a tier is not copied again.

Reads from disk start when a request arrives (`read_ahead`), on the disk reader's thread; the
scheduler admits the request once they are done (`reading`), and a lookup takes the block from
memory then."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engine.kv_offload.block_io import PoolBlockIO, StoredBlocks
from engine.kv_offload.disk_reader import DiskReader
from engine.kv_offload.disk_tier import DiskTier
from engine.kv_offload.disk_writer import DiskWriter
from engine.kv_offload.host_tier import HostTier
from engine.kv_offload.keys import tier_key
from engine.stats import KVOffloadStats


@dataclass
class FoundBlock:
    """A block's contents found in a tier, held in memory: nothing evicts it once found."""

    tier: str
    contents: torch.Tensor
    block_hash: bytes  # the pool's hash it was found by


# Blocks queued for the disk, and blocks read ahead from it, each held in memory up to this.
MAX_DISK_QUEUE_BYTES = 256 * 2**20


class KVOffloadConnector:
    def __init__(
        self, identity: bytes, io: PoolBlockIO, host: HostTier | None, disk: DiskTier | None
    ) -> None:
        self.identity = identity
        self.io = io
        self.host = host
        self.disk = disk
        self._writer = DiskWriter(disk, MAX_DISK_QUEUE_BYTES) if disk is not None else None
        self._reader = DiskReader(disk, MAX_DISK_QUEUE_BYTES) if disk is not None else None
        self._stored: Counter[str] = Counter()
        self._loaded: Counter[str] = Counter()
        self._dropped_before = 0  # the writer's drops counted by earlier stats
        self._host_hash: dict[bytes, bytes] = {}  # tier key -> pool hash, of the host's blocks
        # With KV events on: what entered (True) and left (False) the host tier, by pool hash,
        # in order, until the KV cache manager turns it into events.
        self.host_changes: list[tuple[bool, bytes]] | None = None

    def key(self, block_hash: bytes) -> bytes:
        return tier_key(self.identity, block_hash)

    def find(self, block_hash: bytes) -> FoundBlock | None:
        key = self.key(block_hash)
        if self.host is not None:
            block = self.host.get(key)
            if block is not None:
                return FoundBlock("host", block, block_hash)
        if self._writer is not None:
            block = self._writer.pending(key)
            if block is not None:  # its write is queued: still a disk store
                return FoundBlock("disk", block, block_hash)
        if self._reader is not None:
            block = self._reader.take(key)
            if block is not None:  # read ahead
                self._put_host(key, block_hash, block)
                return FoundBlock("disk", block, block_hash)
        if self.disk is not None:
            block = self.disk.read(key)
            if block is not None:
                self._put_host(key, block_hash, block)  # the next visit finds it in memory
                return FoundBlock("disk", block, block_hash)
        return None

    def _put_host(self, key: bytes, block_hash: bytes, block: torch.Tensor) -> bool:
        """Keep a block in the host tier (if there is one); whether it was taken."""
        if self.host is None:
            return False
        evicted = self.host.put(key, block)
        if evicted is None:
            return False
        self._host_hash[key] = block_hash
        for old in evicted:
            old_hash = self._host_hash.pop(old, None)
            if self.host_changes is not None and old_hash is not None:
                self.host_changes.append((False, old_hash))
        if self.host_changes is not None:
            self.host_changes.append((True, block_hash))
        return True

    def host_block_hashes(self) -> set[bytes]:
        """The pool hashes of the blocks the host tier holds (what KV events say it holds)."""
        return set(self._host_hash.values())

    def read_ahead(self, hashes: list[bytes]) -> None:
        """Start reading the blocks of this chain that only the disk holds, up to the first
        block no tier holds (a lookup stops there)."""
        if self._reader is None or self.disk is None:
            return
        keys = []
        for block_hash in hashes:
            key = self.key(block_hash)
            if (self.host is not None and key in self.host) or self._writer_has(key):
                continue
            if key not in self.disk:
                break
            keys.append(key)
        self._reader.request(keys)

    @property
    def reading_ahead(self) -> bool:
        """Whether any block is being read ahead now: what the scheduler asks before naming
        a request's blocks, so that an idle reader costs it nothing."""
        return self._reader is not None and self._reader.busy

    def reading(self, hashes: list[bytes]) -> bool:
        """Whether any of these blocks is still being read ahead."""
        return self._reader is not None and self._reader.reading([self.key(h) for h in hashes])

    def wait_for_reads(self, hashes: list[bytes]) -> None:
        if self._reader is not None:
            self._reader.wait([self.key(h) for h in hashes])

    def _writer_has(self, key: bytes) -> bool:
        return self._writer is not None and self._writer.pending(key) is not None

    def load(self, found: list[FoundBlock], block_ids: list[int]) -> None:
        """Copy found blocks into the pool's blocks, before any step reads them."""
        self.io.scatter(block_ids, [f.contents for f in found])
        for f in found:
            self._loaded[f.tier] += f.contents.numel() * f.contents.element_size()

    def _held(self, key: bytes) -> bool:
        in_host = self.host is not None and key in self.host
        in_disk = self.disk is None or not self.disk.enabled or key in self.disk
        in_disk = in_disk or self._writer_has(key)
        return (self.host is None or in_host) and in_disk

    def store(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy out the (pool block, block hash) pairs a step has just written, those that
        some tier does not hold yet."""
        todo = [(block_id, self.key(h), h) for block_id, h in blocks]
        todo = [t for t in todo if not self._held(t[1])]
        if not todo:
            return
        stored = self.io.gather([block_id for block_id, _, _ in todo])
        keys = [key for _, key, _ in todo]
        size = stored.blocks[0].numel() * stored.blocks[0].element_size()
        for (_, key, block_hash), block in zip(todo, stored.blocks):
            if self._put_host(key, block_hash, block):
                self._stored["host"] += size
        if self._writer is not None and self.disk is not None and self.disk.enabled:
            new = [(k, b) for k, b in zip(keys, stored.blocks) if k not in self.disk]
            if new:
                dropped = self._writer.num_dropped
                handed = StoredBlocks([b for _, b in new], stored.wait)
                self._writer.submit([k for k, _ in new], handed)
                self._stored["disk"] += size * (len(new) - (self._writer.num_dropped - dropped))

    def take_stats(self) -> KVOffloadStats:
        stats = KVOffloadStats(bytes_stored=dict(self._stored), bytes_loaded=dict(self._loaded))
        self._stored.clear()
        self._loaded.clear()
        if self._writer is not None:
            dropped = self._writer.num_dropped
            stats.blocks_dropped["disk"] = dropped - self._dropped_before
            self._dropped_before = dropped
        for tier in (self.host, self.disk):
            if tier is not None:
                stats.used_bytes[tier.name] = tier.used_bytes
                stats.capacity_bytes[tier.name] = tier.capacity_bytes
        return stats

    def flush(self) -> None:
        """Wait for the disk writes queued so far."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
