"""BlockPool: ref counts, the two free sets and the prefix cache's hash table."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool, NoFreeBlocksError


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def cached_free_pool(num_blocks: int, num_cached: int) -> BlockPool:
    """A pool whose blocks 0..num_cached-1 were used, cached under h(id), and freed in id order."""
    pool = BlockPool(num_blocks, enable_caching=True)
    ids = pool.allocate(num_cached)
    assert ids == list(range(num_cached))
    for block_id in ids:
        pool.cache(block_id, h(block_id))
    for block_id in ids:
        pool.release([block_id])
    return pool


def test_allocate_gives_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(5, enable_caching=False)
    ids = pool.allocate(3) + pool.allocate(2)
    assert sorted(ids) == list(range(5))
    assert all(pool.ref_cnt[b] == 1 for b in ids)
    assert pool.num_free == 0
    assert pool.usage() == 1.0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.release(ids)
    assert pool.num_free == 5
    assert pool.usage() == 0.0


def test_asking_for_more_than_free_changes_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_uncached_free_blocks_are_handed_out_before_cached_ones() -> None:
    pool = cached_free_pool(num_blocks=6, num_cached=3)
    # Blocks 3..5 never held content: they go first, so the cached blocks 0..2 survive.
    assert sorted(pool.allocate(3)) == [3, 4, 5]
    assert [pool.lookup(h(i)) for i in range(3)] == [0, 1, 2]
    assert pool.num_evictions == 0


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    ids = pool.allocate(4)
    for block_id in ids:
        pool.cache(block_id, h(block_id))
    # Freed in the order 2, 0, 3, 1: that is the eviction order.
    for block_id in (2, 0, 3, 1):
        pool.release([block_id])
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [0, 3]
    assert pool.num_evictions == 3
    assert pool.lookup(h(1)) == 1


def test_eviction_drops_the_hash_so_lookup_misses() -> None:
    pool = cached_free_pool(num_blocks=2, num_cached=2)
    (block_id,) = pool.allocate(1)
    assert block_id == 0
    assert pool.lookup(h(0)) is None
    assert pool.block_hash[0] is None
    assert pool.lookup(h(1)) == 1
    # The evicted block is now plain: released again, it is a plain free block, not a cached one.
    pool.release([0])
    pool.check_consistency({})
    assert pool.allocate(1) == [0]
    assert pool.lookup(h(1)) == 1


def test_a_hit_takes_a_cached_free_block_out_of_the_free_set() -> None:
    pool = cached_free_pool(num_blocks=3, num_cached=3)
    assert pool.num_free == 3
    hit = pool.lookup(h(1))
    assert hit == 1
    pool.take(hit)
    assert pool.ref_cnt[1] == 1
    assert pool.num_free == 2
    pool.check_consistency({1: 1})
    # The taken block can no longer be handed out: two allocations evict 0 and 2, never 1.
    assert sorted(pool.allocate(2)) == [0, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.lookup(h(1)) == 1


def test_a_block_released_after_a_hit_is_cached_again_as_most_recent() -> None:
    pool = cached_free_pool(num_blocks=3, num_cached=3)
    pool.take(0)
    pool.release([0])
    assert pool.num_free == 3
    assert pool.lookup(h(0)) == 0
    pool.check_consistency({})
    # 0 is now the most recently freed: it is evicted last.
    assert pool.allocate(3) == [1, 2, 0]


def test_take_on_a_block_in_use_adds_a_reference() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block_id,) = pool.allocate(1)
    pool.take(block_id)
    assert pool.ref_cnt[block_id] == 2
    pool.release([block_id])
    assert pool.num_free == 1
    pool.release([block_id])
    assert pool.num_free == 2


def test_releasing_a_free_block_raises() -> None:
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(AssertionError):
        pool.release([0])
    (block_id,) = pool.allocate(1)
    pool.release([block_id])
    with pytest.raises(AssertionError):
        pool.release([block_id])


def test_first_block_cached_under_a_hash_wins() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, h(7))
    pool.cache(b, h(7))
    assert pool.lookup(h(7)) == a
    assert pool.block_hash[b] is None
    # A block keeps its first hash.
    pool.cache(a, h(8))
    assert pool.lookup(h(8)) is None
    # b has no hash, so freeing it makes it a plain free block, handed out before cached ones.
    pool.release([a, b])
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [b]
    assert pool.lookup(h(7)) == a


def test_caching_disabled_never_registers() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block_id,) = pool.allocate(1)
    pool.cache(block_id, h(1))
    assert pool.lookup(h(1)) is None
    assert pool.block_hash[block_id] is None


def test_check_consistency_catches_a_wrong_ref_count() -> None:
    pool = BlockPool(3, enable_caching=False)
    (block_id,) = pool.allocate(1)
    pool.check_consistency({block_id: 1})
    with pytest.raises(AssertionError):
        pool.check_consistency({block_id: 2})
    with pytest.raises(AssertionError):
        pool.check_consistency({})
