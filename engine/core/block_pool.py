"""The physical KV block pool: ref counts, free blocks, and the prefix cache's hash table.

A block whose ref count drops to 0 goes back to the free pool but keeps its hash, so a later
request with the same prefix can take it back (a hit). Free blocks without a hash are handed
out first; cached free blocks are evicted least-recently-freed first. Both free sets are
insertion-ordered dicts, so a hit removes its block in O(1). A block's state is two list
entries, not an object: a 1 GiB pool of a small model holds hundreds of thousands of blocks, and
as many objects cost a second of start-up (mostly garbage-collector passes over the heap).

With KV events on, an eviction is recorded (one BlockRemoved per allocation that evicts);
stores are recorded by the KV cache manager, which knows the blocks' tokens.
"""

from __future__ import annotations

from engine.kv_events.events import BlockRemoved, KVEventRecorder

BlockHash = bytes


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool, events: KVEventRecorder | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.events = events
        self.enable_caching = enable_caching
        self.ref_cnt: list[int] = [0] * num_blocks  # references held by block tables
        self.block_hash: list[BlockHash | None] = [None] * num_blocks  # its prefix-cache key
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
                gone = self._evict(block_id)
                if gone is not None:
                    evicted.append(gone)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        if evicted and self.events is not None:
            self.events.events.append(BlockRemoved(evicted))
        return ids

    def take(self, block_id: int) -> None:
        """Add a reference to a block in use or a cached free block (a prefix hit or a fork)."""
        if self.ref_cnt[block_id] == 0:
            del self._free_cached[block_id]
        self.ref_cnt[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; callers pass a table's tail first, so the
        least useful blocks of a sequence are the first to be evicted later."""
        ref_cnt = self.ref_cnt
        for block_id in block_ids:
            if ref_cnt[block_id] <= 0:
                raise AssertionError(f"block {block_id} released while free")
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self._free_plain[block_id] = None
                else:
                    self._free_cached[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block under its chained hash (the first block with that content
        wins); whether this block was registered."""
        if not self.enable_caching:
            return False
        if self.block_hash[block_id] is None and block_hash not in self._cached:
            self.block_hash[block_id] = block_hash
            self._cached[block_hash] = block_id
            return True
        return False

    def uncache(self, block_id: int) -> None:
        """Take a block's hash away (its contents were never written): a free one becomes plain."""
        old = self.block_hash[block_id]
        if old is None:
            return
        del self._cached[old]
        self.block_hash[block_id] = None
        if self.ref_cnt[block_id] == 0:
            del self._free_cached[block_id]
            self._free_plain[block_id] = None

    def cached_hashes(self) -> set[BlockHash]:
        """Every hash a lookup can find now (what KV event subscribers should believe)."""
        return set(self._cached)

    def _evict(self, block_id: int) -> BlockHash | None:
        """Drop a block's hash from the cache; the hash dropped, if it had one."""
        gone = self.block_hash[block_id]
        if gone is not None:
            del self._cached[gone]
            self.block_hash[block_id] = None
            self.num_evictions += 1
        return gone

    def check_consistency(self, expected_refs: dict[int, int]) -> None:
        """Assert the pool agrees with the references the tables hold (tests and debugging)."""
        for block_id, count in enumerate(self.ref_cnt):
            refs = expected_refs.get(block_id, 0)
            assert count == refs, f"block {block_id}: ref_cnt {count} != {refs}"
            free = block_id in self._free_plain or block_id in self._free_cached
            assert free == (refs == 0), f"block {block_id}: free={free} with {refs} refs"
        for block_hash, block_id in self._cached.items():
            assert self.block_hash[block_id] == block_hash
