"""The physical KV block pool: ref counts, free blocks, and the prefix cache's hash table.

A block whose ref count drops to 0 goes back to the free pool but keeps its hash, so a later
request with the same prefix can take it back (a hit). Free blocks without a hash are handed
out first; cached free blocks are evicted least-recently-freed first. Both free sets are
insertion-ordered dicts, so a hit removes its block in O(1).

With KV events on, an eviction is recorded (one BlockRemoved per allocation that evicts);
stores are recorded by the KV cache manager, which knows the blocks' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_events.events import BlockRemoved, KVEventRecorder

BlockHash = bytes


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool, events: KVEventRecorder | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.events = events
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_plain: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._free_cached: dict[int, None] = {}  # LRU order: oldest first
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free} free")
        ids = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            if self._free_plain:
                block_id = next(iter(self._free_plain))
                del self._free_plain[block_id]
            else:
                block_id = next(iter(self._free_cached))
                del self._free_cached[block_id]
                gone = self._evict(self.blocks[block_id])
                if gone is not None:
                    evicted.append(gone)
            self.blocks[block_id].ref_cnt = 1
            ids.append(block_id)
        if evicted and self.events is not None:
            self.events.events.append(BlockRemoved(evicted))
        return ids

    def take(self, block_id: int) -> None:
        """Add a reference to a block in use or a cached free block (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free_cached[block_id]
        block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; callers pass a table's tail first, so the
        least useful blocks of a sequence are the first to be evicted later."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block_id} released while free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_plain[block_id] = None
                else:
                    self._free_cached[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block under its chained hash (the first block with that content
        wins); whether this block was registered."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block_id
            return True
        return False

    def uncache(self, block_id: int) -> None:
        """Take a block's hash away (its contents were never written): a free one becomes plain."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        block.block_hash = None
        if block.ref_cnt == 0:
            del self._free_cached[block_id]
            self._free_plain[block_id] = None

    def cached_hashes(self) -> set[BlockHash]:
        """Every hash a lookup can find now (what KV event subscribers should believe)."""
        return set(self._cached)

    def _evict(self, block: KVBlock) -> BlockHash | None:
        """Drop a block's hash from the cache; the hash dropped, if it had one."""
        gone = block.block_hash
        if gone is not None:
            del self._cached[gone]
            block.block_hash = None
            self.num_evictions += 1
        return gone

    def check_consistency(self, expected_refs: dict[int, int]) -> None:
        """Assert the pool agrees with the references the tables hold (tests and debugging)."""
        for block in self.blocks:
            refs = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == refs, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs}"
            )
            free = block.block_id in self._free_plain or block.block_id in self._free_cached
            assert free == (refs == 0), f"block {block.block_id}: free={free} with {refs} refs"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
