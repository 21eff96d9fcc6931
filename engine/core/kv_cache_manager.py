"""Per-sequence block tables over the block pool, with prefix caching and copy-on-write.

A full block is identified by a chained hash: hash(parent block's hash, this block's tokens),
so equal hashes mean equal whole prefixes. The first block's parent is the sequence's LoRA
adapter's salt (empty for the base model), so no prefix is shared across adapters. Blocks are registered in the cache as soon as they
are scheduled full with known tokens (a token still being sampled waits for the sequence's next
step): their K/V is written by that step or one before it, before any attention reads it.

When every layer attends through a sliding window, a block whose tokens all lie before the
window of the next query is read by no layer again: it goes back to the pool (keeping its
hash, so a later prompt with the same prefix still finds it) and its table entry becomes
`SLID_PAST`. The attention backends start each row at its window, so they never read it.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_pool import BlockHash, BlockPool
from engine.core.sequence import Sequence
from engine.kv_events.events import (
    HOST_TIER,
    POOL,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventRecorder,
)

if TYPE_CHECKING:
    from engine.kv_offload.connector import FoundBlock, KVOffloadConnector

SLID_PAST = -1  # a table entry whose block every layer's window has left behind


def chain_hash(parent: BlockHash, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """`extra`: the content hashes of the images the block's tokens stand for (their
    placeholder tokens are alike whatever the image)."""
    data = parent + array("q", token_ids).tobytes() + extra
    return hashlib.blake2b(data, digest_size=16).digest()


def block_images(seq: Sequence, index: int, block_size: int) -> list[bytes]:
    """The hashes of the images whose spans overlap block `index` of the sequence."""
    if seq.mm is None:
        return []
    start = index * block_size
    return [item.hash for item in seq.mm.items_in(start, start + block_size)]


@dataclass
class _StepStores:
    # seq_id -> (blocks it had registered before the step, the blocks the step registered)
    registered: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    events: list[BlockStored] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None = None,
        record_events: bool = False,
        offload: KVOffloadConnector | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window  # the widest window, when every layer has one
        self._num_slid: dict[str, int] = {}
        # KV events (stores here, evictions in the pool), taken once per step by the engine.
        self.events = KVEventRecorder() if record_events else None
        self.pool = BlockPool(num_blocks, enable_caching, self.events)
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        # (src, dst) block copies the next forward pass must make before it writes (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        # What this step registered, so that a step that does not run can take it back.
        self._step_stores = _StepStores()
        # KV offload tiers: asked after the pool's own prefix hits; the blocks registered
        # since the last step ran are stored to them once it has written them.
        self.offload = offload
        self._offload_new: list[tuple[int, BlockHash]] = []
        # With KV events on, the host tier's stores and evictions are events too ("CPU"): the
        # sequence and block index of each block on its way there, for its tokens.
        self._tier_blocks: dict[BlockHash, tuple[Sequence, int]] | None = None
        if offload is not None and self.events is not None:
            offload.host_changes = []
            self._tier_blocks = {}

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables.get(seq.seq_id, [])

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        # The chain starts from the adapter's salt: a LoRA adapter changes every layer's K/V.
        root = b"" if seq.lora is None else seq.lora.cache_salt
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(
                chain_hash(
                    hashes[-1] if hashes else root,
                    seq.all_token_ids[i * bs : (i + 1) * bs],
                    b"".join(block_images(seq, i, bs)),
                )
            )
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest cached run of the sequence's full blocks. The last token is never taken
        from the cache: its logits are needed to sample."""
        if not self.enable_caching or seq.wants_prompt_logprobs:
            return []
        hits = []
        for block_hash in self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _tier_hashes(self, seq: Sequence) -> list[BlockHash]:
        """The prompt's full blocks the tiers may be asked for: those the pool does not hold."""
        if self.offload is None or not self.enable_caching or seq.wants_prompt_logprobs:
            return []
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        return [h for h in hashes if self.pool.lookup(h) is None]

    def read_ahead(self, seq: Sequence) -> None:
        """Start reading the blocks of the prompt that only the disk tier holds."""
        if self.offload is not None:
            self.offload.read_ahead(self._tier_hashes(seq))

    def tier_reads_pending(self, seq: Sequence) -> bool:
        """Whether the disk tier is still reading blocks of the prompt (asked at every admission
        attempt: the prompt's hashes are named only while some read is in flight)."""
        offload = self.offload
        return (
            offload is not None
            and offload.reading_ahead
            and offload.reading(self._tier_hashes(seq))
        )

    def wait_for_tier_reads(self, seq: Sequence) -> None:
        if self.offload is not None:
            self.offload.wait_for_reads(self._tier_hashes(seq))

    def load_offloaded(
        self, seq: Sequence, hits: list[int], max_new_tokens: int
    ) -> tuple[list[int], int]:
        """After the pool's own `hits`, the prompt's next full blocks found in the offload
        tiers, copied into free pool blocks and cached there (as prefix hits, the last token's
        block never among them): the hits extended, and how many blocks were loaded. A block
        is loaded only while the pool keeps room for the rest of a `max_new_tokens` chunk;
        the pool's hits are held while loading, so the blocks it takes never evict them."""
        if self.offload is None or not self.enable_caching or seq.wants_prompt_logprobs:
            return hits, 0
        bs = self.block_size
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // bs)
        if len(hits) >= len(hashes):
            return hits, 0
        held = list(hits)
        for block_id in held:
            self.pool.take(block_id)
        try:
            plan: list[int | FoundBlock] = []  # a pool block, or contents to load into one
            num_found = 0
            for i in range(len(hits), len(hashes)):
                in_pool = self.pool.lookup(hashes[i])  # the pool may hold a later block
                if in_pool is not None:
                    self.pool.take(in_pool)
                    held.append(in_pool)
                    plan.append(in_pool)
                    continue
                rest = -(-min(seq.num_tokens - (i + 1) * bs, max_new_tokens) // bs)
                if num_found + 1 + rest > self.pool.num_free:
                    break
                self._note_tier_block(seq, i, hashes[i])
                found = self.offload.find(hashes[i])
                if found is None:
                    break
                plan.append(found)
                num_found += 1
            while num_found > self.pool.num_free:  # later pool hits took free blocks
                if not isinstance(plan.pop(), int):
                    num_found -= 1
            if num_found == 0:
                return hits, 0
            new_ids = self.pool.allocate(num_found)  # evicts neither held nor loaded blocks
            held.extend(new_ids)
            self.offload.load([p for p in plan if not isinstance(p, int)], new_ids)
            loaded = iter(new_ids)
            blocks = list(hits)
            for i, p in enumerate(plan, start=len(hits)):
                block_id = p if isinstance(p, int) else next(loaded)
                if not isinstance(p, int):
                    self.pool.cache(block_id, hashes[i])
                    # Subscribers learn of it as of any block stored; no step can take it back.
                    self._record_stored(seq, hashes, i, i + 1, in_step=False)
                blocks.append(block_id)
            return blocks, num_found
        finally:
            # Back to the cached free blocks (the tail first), until allocate_slots takes them.
            self.pool.release(held[::-1])
            self._record_tier_changes(hashes[len(hits) :])  # blocks read from disk into host

    def _take_offload_stores(self) -> list[tuple[int, BlockHash]]:
        """The (block, hash) pairs registered since the last call whose K/V the step that just
        ran has written: a block the step gave back unwritten (`unregister_step`) is left out."""
        new, self._offload_new = self._offload_new, []
        return [(b, h) for b, h in new if self.pool.block_hash[b] == h]

    def store_offloaded(self) -> None:
        """Copy the blocks the step that just ran has written to the tiers."""
        assert self.offload is not None
        new = self._offload_new
        self.offload.store(self._take_offload_stores())
        self._record_tier_changes([h for _, h in new])

    def _note_tier_block(self, seq: Sequence, index: int, block_hash: BlockHash) -> None:
        if self._tier_blocks is not None:
            self._tier_blocks[block_hash] = (seq, index)

    def _record_tier_changes(self, done: list[BlockHash]) -> None:
        """The host tier's changes as events, in order; `done`: the blocks noted for them."""
        if self._tier_blocks is None or self.events is None or self.offload is None:
            return
        changes = self.offload.host_changes or []
        removed: list[BlockHash] = []
        for stored, block_hash in changes:
            if not stored:
                removed.append(block_hash)
                continue
            if removed:
                self.events.events.append(BlockRemoved(removed, HOST_TIER))
                removed = []
            noted = self._tier_blocks.get(block_hash)
            if noted is None:  # not put there through this manager (a test filling the tier)
                continue
            seq, index = noted
            hashes = self._hashes.get(seq.seq_id, [])
            if len(hashes) <= index:  # its sequence is gone: its tokens with it
                continue
            self.events.events.append(self._block_stored(seq, hashes, index, index + 1, HOST_TIER))
        if removed:
            self.events.events.append(BlockRemoved(removed, HOST_TIER))
        changes.clear()
        for block_hash in done:
            self._tier_blocks.pop(block_hash, None)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus the prefix
        hits in `computed_blocks`, for a sequence being admitted): the sequence's block table
        that holds them. None, with nothing changed, when the pool is too short."""
        computed_blocks = computed_blocks or []
        bs = self.block_size
        table = self.tables.setdefault(seq.seq_id, [])
        start = seq.num_planned_computed + len(computed_blocks) * bs
        end = start + num_new_tokens
        num_new_blocks = max(0, -(-end // bs) - len(table) - len(computed_blocks))
        # The first block written may be a partial block shared with a forked sibling.
        cow = start % bs != 0 and num_new_tokens > 0 and self.pool.ref_cnt[table[start // bs]] > 1
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_new_blocks + int(cow) + revived > self.pool.num_free:
            return None
        for block_id in computed_blocks:
            self.pool.take(block_id)
        table.extend(computed_blocks)
        if cow:
            shared = table[start // bs]
            (private,) = self.pool.allocate(1)
            self.pending_copies.append((shared, private))
            self.pool.release([shared])
            table[start // bs] = private
        table.extend(self.pool.allocate(num_new_blocks))
        # Only blocks whose tokens are all known: a token still being sampled (async scheduling)
        # completes its block's hash at the sequence's next step.
        self._register_full_blocks(seq, table, min(end, seq.num_tokens) // bs)
        self._release_slid_past(seq.seq_id, table, start)
        return table

    def _release_slid_past(self, seq_id: str, table: list[int], first_query: int) -> None:
        """Free the blocks before the window of the row at `first_query` (the earliest any
        query of this step or a later one reaches back to)."""
        if self.sliding_window is None:
            return
        unneeded = max(0, first_query - self.sliding_window + 1) // self.block_size
        done = self._num_slid.get(seq_id, 0)
        for i in range(done, unneeded):
            if table[i] != SLID_PAST:  # a forked child's copy of a parent's table may have some
                self.pool.release([table[i]])
                table[i] = SLID_PAST
        self._num_slid[seq_id] = max(done, unneeded)

    def _register_full_blocks(self, seq: Sequence, table: list[int], num_full: int) -> None:
        if not self.enable_caching:
            return
        done = self._num_registered.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(seq, num_full)
        self._step_stores.registered.setdefault(seq.seq_id, (done, []))
        run_start = None  # the first block of the run of newly registered blocks
        for i in range(done, num_full):
            if self.pool.cache(table[i], hashes[i]):
                self._step_stores.registered[seq.seq_id][1].append(table[i])
                if self.offload is not None:
                    self._offload_new.append((table[i], hashes[i]))
                    self._note_tier_block(seq, i, hashes[i])
                if run_start is None:
                    run_start = i
            elif run_start is not None:
                self._record_stored(seq, hashes, run_start, i)
                run_start = None
        if run_start is not None:
            self._record_stored(seq, hashes, run_start, num_full)
        self._num_registered[seq.seq_id] = num_full

    def _record_stored(
        self, seq: Sequence, hashes: list[BlockHash], start: int, end: int, in_step: bool = True
    ) -> None:
        """One BlockStored for blocks [start, end) of the sequence: a block already cached
        under another copy is not stored again, so a run ends there (its hash is still the
        next run's parent, as the chain says)."""
        if self.events is None:
            return
        stored = self._block_stored(seq, hashes, start, end, POOL)
        self.events.events.append(stored)
        if in_step:
            self._step_stores.events.append(stored)

    def _block_stored(
        self, seq: Sequence, hashes: list[BlockHash], start: int, end: int, medium: str
    ) -> BlockStored:
        bs = self.block_size
        return BlockStored(
            hashes[start:end],
            hashes[start - 1] if start > 0 else None,
            seq.all_token_ids[start * bs : end * bs],
            bs,
            None if seq.lora is None else seq.lora.lora_int_id,
            None if seq.lora is None else seq.lora.lora_name,
            self._extra_keys(seq, start, end),
            medium,
        )

    def _extra_keys(self, seq: Sequence, start: int, end: int) -> list[list[str] | None] | None:
        """Per block, the hex hashes of the images it covers (vLLM's `extra_keys`); None when
        no block covers any."""
        if seq.mm is None:
            return None
        keys = [
            [h.hex() for h in block_images(seq, i, self.block_size)] or None
            for i in range(start, end)
        ]
        return keys if any(keys) else None

    def begin_step(self) -> None:
        """A step is about to be scheduled: what it registers can be taken back until the next."""
        self._step_stores = _StepStores()

    def unregister_step(self) -> None:
        """The step scheduled since `begin_step` will not run: its blocks' K/V is never written,
        so the blocks it registered by hash leave the cache (a later prompt must not hit them),
        their BlockStored events are dropped, and each sequence registers them again when a
        step that runs computes them."""
        for seq_id, (done, block_ids) in self._step_stores.registered.items():
            for block_id in block_ids:
                self.pool.uncache(block_id)
            if seq_id in self._num_registered:
                self._num_registered[seq_id] = done
        if self.events is not None:
            dropped = {id(e) for e in self._step_stores.events}
            self.events.events[:] = [e for e in self.events.events if id(e) not in dropped]
        self._step_stores = _StepStores()

    def take_events(self) -> list[KVEvent]:
        return self.events.take() if self.events is not None else []

    def fork(self, parent: Sequence, child: Sequence, num_shared_tokens: int | None = None) -> None:
        """Give `child` the parent's blocks (shared, ref counted); writes copy on demand.
        The child's tokens equal the parent's up to `num_shared_tokens` (the prompt, unless
        told more: a beam forks with all of its parent's tokens), so their blocks' hashes
        are the parent's."""
        shared = child.num_prompt_tokens if num_shared_tokens is None else num_shared_tokens
        # Only the shared tokens' blocks: the parent may already hold one for its next token.
        table = self.tables[parent.seq_id][: -(-shared // self.block_size)]
        for block_id in table:
            if block_id != SLID_PAST:
                self.pool.take(block_id)
        self.tables[child.seq_id] = table
        self._num_slid[child.seq_id] = self._num_slid.get(parent.seq_id, 0)
        num_shared_blocks = shared // self.block_size
        self._hashes[child.seq_id] = self._hashes.get(parent.seq_id, [])[:num_shared_blocks]
        self._num_registered[child.seq_id] = min(
            self._num_registered.get(parent.seq_id, 0), num_shared_blocks
        )

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, [])
        self.pool.release([b for b in table[::-1] if b != SLID_PAST])
        self._num_slid.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_consistency(self) -> None:
        refs: dict[int, int] = {}
        for table in self.tables.values():
            for block_id in table:
                if block_id != SLID_PAST:
                    refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_consistency(refs)
