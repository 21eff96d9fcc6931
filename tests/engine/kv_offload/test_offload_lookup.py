"""The KV cache manager's lookup in the offload tiers, on a real connector over a small cache
whose slots hold their own token ids (a "forward pass" writes them), so a block loaded into
the wrong pool block, or with the wrong contents, reads back wrong: tier hits are loaded and
cached as prefix blocks, the pool's own hits are never evicted by the blocks loaded after
them, a block evicted from its tier between lookup and load still loads, a later block the
pool holds joins the run, and subscribers to KV events learn of loaded blocks."""

from __future__ import annotations

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.kv_events.events import BlockStored
from engine.kv_offload.block_io import PoolBlockIO
from engine.kv_offload.connector import FoundBlock, KVOffloadConnector
from engine.kv_offload.host_tier import HostTier
from engine.sampling_params import SamplingParams

BS = 4
BLOCK_BYTES = 2 * BS * 4  # K and V of one layer, one head of one float32


class Cache:
    def __init__(self, num_blocks: int) -> None:
        self.k = torch.zeros(num_blocks, BS, 1, 1)
        self.v = torch.zeros(num_blocks, BS, 1, 1)

    def forward(self, table: list[int], tokens: list[int]) -> None:
        for pos, token in enumerate(tokens):
            self.k[table[pos // BS], pos % BS] = token
            self.v[table[pos // BS], pos % BS] = -token

    def tokens(self, block_id: int) -> list[int]:
        assert torch.equal(self.v[block_id], -self.k[block_id])
        return [int(x) for x in self.k[block_id].flatten()]


def setup(num_blocks: int) -> tuple[KVCacheManager, Cache, KVOffloadConnector]:
    cache = Cache(num_blocks)
    io = PoolBlockIO(lambda: [(cache.k, cache.v)])
    connector = KVOffloadConnector(b"m" * 16, io, HostTier(32 * BLOCK_BYTES), None)
    kv = KVCacheManager(num_blocks, BS, True, record_events=True, offload=connector)
    return kv, cache, connector


def seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, name, 0, list(tokens), SamplingParams(), 0.0)


def compute(kv: KVCacheManager, cache: Cache, s: Sequence) -> list[int]:
    """Admit, run and free a whole prompt; its full blocks go to the tiers."""
    hits = kv.get_computed_blocks(s)
    table = kv.allocate_slots(s, s.num_tokens - len(hits) * BS, hits)
    assert table is not None
    cache.forward(table, s.all_token_ids)
    kv.store_offloaded()
    kv.free(s)
    return table


PROMPT = list(range(1, 14))  # 3 full blocks before the last token's


def test_tier_hits_are_loaded_and_cached_as_prefix_blocks() -> None:
    kv, cache, _ = setup(6)
    compute(kv, cache, seq("a", PROMPT))
    compute(kv, cache, seq("b", list(range(100, 124))))  # 6 blocks: evicts all of a's
    again = seq("a2", PROMPT)
    assert kv.get_computed_blocks(again) == []
    kv.take_events()
    hits, loaded = kv.load_offloaded(again, [], max_new_tokens=64)
    assert loaded == 3 and len(hits) == 3
    assert [cache.tokens(b) for b in hits] == [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12]]
    assert kv.get_computed_blocks(again) == hits  # cached: now the pool's own hits
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == kv._block_hashes(again, 3)
    assert kv.allocate_slots(again, 1, hits) is not None
    kv.check_consistency()
    kv.free(again)
    kv.check_consistency()


def test_the_pools_hits_are_not_evicted_by_the_blocks_loaded_after_them() -> None:
    kv, cache, _ = setup(4)
    table = compute(kv, cache, seq("a", PROMPT))
    kv.pool.uncache(table[1])  # the pool keeps a's first block only; the tier has all three
    kv.pool.uncache(table[2])
    compute(kv, cache, seq("c", list(range(300, 312))))  # 3 blocks, cached after a's first
    assert kv.pool.num_free == 4 and not kv.pool._free_plain  # loading must evict
    again = seq("a2", PROMPT)
    pool_hits = kv.get_computed_blocks(again)
    assert pool_hits == [table[0]]  # the oldest of the cached free blocks
    hits, loaded = kv.load_offloaded(again, pool_hits, max_new_tokens=1)
    assert loaded == 2 and hits[0] == table[0]
    assert [cache.tokens(b) for b in hits] == [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12]]
    assert kv.get_computed_blocks(again) == hits
    assert kv.allocate_slots(again, 1, hits) is not None
    kv.check_consistency()


def test_a_block_evicted_from_its_tier_between_lookup_and_load_still_loads() -> None:
    kv, cache, connector = setup(6)
    compute(kv, cache, seq("a", PROMPT))
    compute(kv, cache, seq("b", list(range(100, 124))))
    find = connector.find
    host = connector.host
    assert host is not None

    def find_then_flood(block_hash: bytes) -> FoundBlock | None:
        found = find(block_hash)
        for i in range(host.capacity_bytes // BLOCK_BYTES):  # evicts every block of the tier
            host.put(bytes([i % 256, i // 256]) * 8, torch.full((1, 2, BS, 1, 1), -7.0))
        return found

    connector.find = find_then_flood  # type: ignore[method-assign]
    again = seq("a2", PROMPT)
    hits, loaded = kv.load_offloaded(again, [], max_new_tokens=64)
    # The first block was found and held, then the flood took the rest from the tier.
    assert loaded == 1
    assert cache.tokens(hits[0]) == PROMPT[0:4]
    kv.check_consistency()


def test_a_later_block_the_pool_holds_joins_the_run() -> None:
    kv, cache, _ = setup(8)
    table = compute(kv, cache, seq("a", PROMPT))
    kv.pool.uncache(table[1])  # the pool lost the middle block only; the tier has it
    again = seq("a2", PROMPT)
    pool_hits = kv.get_computed_blocks(again)
    assert pool_hits == [table[0]]
    hits, loaded = kv.load_offloaded(again, pool_hits, max_new_tokens=64)
    assert loaded == 1 and hits[0] == table[0] and hits[2] == table[2] and hits[1] != table[1]
    assert [cache.tokens(b) for b in hits] == [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12]]
    kv.check_consistency()
