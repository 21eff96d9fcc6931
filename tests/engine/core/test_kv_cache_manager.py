"""KVCacheManager: block tables, prefix-cache hits, forks and copy-on-write.

The property test drives the manager with random operations and keeps a shadow of what every
KV slot holds: each "forward pass" applies the pending block copies, then writes each new
token into the slot its table maps it to. Every live sequence must then read back exactly its
own tokens through its table, so a wrong hit, a missed copy-on-write or a block handed to two
writers shows up as a wrong token.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.models import finish_all

ALPHABET = st.integers(0, 2)  # few distinct tokens, so prefixes repeat and the cache hits


def make_sequence(seq_id: str, tokens: list[int], params: SamplingParams | None = None) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(tokens), params or SamplingParams(), 0.0)


class Sim:
    """A KVCacheManager plus the shadow contents of its slots and the sequences using it."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.num_blocks = num_blocks
        self.bs = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.live: dict[str, Sequence] = {}  # sequences holding blocks
        self.waiting: list[
            Sequence
        ] = []  # never admitted, or preempted: no blocks, nothing computed
        self.history: list[
            list[int]
        ] = []  # every token list seen, to build prompts that share prefixes
        self._ids = itertools.count()
        self.num_hit_blocks = 0
        self.num_copies = 0

    def new_sequence(self, tokens: list[int]) -> Sequence:
        self.history.append(list(tokens))
        return make_sequence(f"r{next(self._ids)}", tokens)

    def _state(self) -> tuple:
        pool = self.kv.pool
        return (
            {rid: list(t) for rid, t in self.kv.tables.items() if t},
            list(zip(pool.ref_cnt, pool.block_hash)),
            pool.num_free,
            list(self.kv.pending_copies),
        )

    def run(self, req: Sequence, num_new: int, hits: list[int] | None = None) -> bool:
        """allocate_slots, then the forward pass that writes the new tokens' K/V."""
        hits = hits or []
        pool = self.kv.pool
        before = self._state()
        free_before = {b for b, refs in enumerate(pool.ref_cnt) if refs == 0}
        old_table = list(self.kv.block_table(req))
        start = req.num_computed_tokens + len(hits) * self.bs
        shared_partial = None
        if start % self.bs and num_new > 0 and pool.ref_cnt[old_table[start // self.bs]] > 1:
            shared_partial = old_table[start // self.bs]

        if self.kv.allocate_slots(req, num_new, hits or None) is None:
            assert self._state() == before, "a failed allocate_slots changed state"
            return False

        table = self.kv.tables[req.seq_id]
        copies = self.kv.take_pending_copies()
        assert len(table) == -(-(start + num_new) // self.bs)
        assert table[: len(hits)] == hits
        new_blocks = set(table) - set(old_table) - set(hits)
        assert new_blocks <= free_before, "allocate handed out a block in use"
        if shared_partial is None:
            assert copies == []
        else:
            # Copy-on-write: the writer gets a private block holding a copy of the shared one.
            (private,) = [b for b in new_blocks if b == table[start // self.bs]]
            assert copies == [(shared_partial, private)]
            assert pool.ref_cnt[private] == 1
            self.num_copies += 1
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        req.num_computed_tokens = start
        for p in range(start, start + num_new):
            self.slots[table[p // self.bs]][p % self.bs] = req.all_token_ids[p]
        req.num_computed_tokens += num_new
        self.live[req.seq_id] = req
        return True

    def admit(self, req: Sequence, chunk: int) -> None:
        hits = self.kv.get_computed_blocks(req)
        if not self.kv.enable_caching:
            assert hits == []
        # The last token is never served from the cache: its logits are needed.
        assert len(hits) * self.bs < req.num_tokens
        assert len(set(hits)) == len(hits)
        num_new = min(chunk, req.num_tokens - len(hits) * self.bs)
        if self.run(req, num_new, hits):
            self.num_hit_blocks += len(hits)
        else:
            self.waiting.append(req)

    def fork(self, parent: Sequence) -> None:
        # Like n > 1: the child starts from everything the parent has computed.
        assert parent.num_computed_tokens == parent.num_tokens
        child = self.new_sequence(parent.all_token_ids)
        refs = [self.kv.pool.ref_cnt[b] for b in self.kv.tables[parent.seq_id]]
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        assert self.kv.tables[child.seq_id] == self.kv.tables[parent.seq_id]
        assert [self.kv.pool.ref_cnt[b] for b in self.kv.tables[child.seq_id]] == [
            r + 1 for r in refs
        ]
        self.live[child.seq_id] = child

    def free(self, req: Sequence) -> None:
        self.kv.free(req)
        del self.live[req.seq_id]

    def preempt(self, req: Sequence) -> None:
        self.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    def check(self) -> None:
        self.kv.check_consistency()
        pool = self.kv.pool
        holders: dict[int, int] = {}
        for rid, table in self.kv.tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice"
            for b in table:
                holders[b] = holders.get(b, 0) + 1
            if table:
                assert rid in self.live
        for b, refs in enumerate(pool.ref_cnt):
            # A block in two tables is shared: its ref count is its number of holders.
            assert refs == holders.get(b, 0)
        assert pool.num_free + len(holders) == self.num_blocks
        assert pool.num_free == pool.ref_cnt.count(0)
        for req in self.live.values():
            table = self.kv.tables[req.seq_id]
            assert len(table) == -(-req.num_computed_tokens // self.bs)
            seen = [
                self.slots[table[p // self.bs]][p % self.bs] for p in range(req.num_computed_tokens)
            ]
            assert seen == req.all_token_ids[: req.num_computed_tokens], (
                f"{req.seq_id} reads wrong K/V"
            )
        for req in self.waiting:
            assert req.num_computed_tokens == 0 and not self.kv.block_table(req)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    caching=st.booleans(),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 14),
)
def test_random_operations_keep_tables_pool_and_contents_consistent(
    data: st.DataObject, caching: bool, block_size: int, num_blocks: int
) -> None:
    sim = Sim(num_blocks, block_size, caching)
    # Appends and forks are listed twice: together they make the copies-on-write.
    ops = [
        "new",
        "new_shared",
        "admit_waiting",
        "compute",
        "append",
        "append",
        "fork",
        "fork",
        "free",
        "preempt",
    ]
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(ops))
        live = sorted(sim.live)
        done = [
            sim.live[r] for r in live if sim.live[r].num_computed_tokens == sim.live[r].num_tokens
        ]
        todo = [
            sim.live[r] for r in live if sim.live[r].num_computed_tokens < sim.live[r].num_tokens
        ]
        if op == "new" or (op == "new_shared" and not sim.history):
            tokens = data.draw(st.lists(ALPHABET, min_size=1, max_size=12))
            sim.admit(sim.new_sequence(tokens), data.draw(st.integers(1, 12)))
        elif op == "new_shared":
            # A prefix of an earlier sequence plus a fresh tail: a likely prefix-cache hit.
            base = data.draw(st.sampled_from(sim.history))
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + data.draw(st.lists(ALPHABET, min_size=1, max_size=4))
            sim.admit(sim.new_sequence(tokens), data.draw(st.integers(1, 16)))
        elif op == "admit_waiting" and sim.waiting:
            req = sim.waiting.pop(data.draw(st.integers(0, len(sim.waiting) - 1)))
            sim.admit(req, data.draw(st.integers(1, 16)))
        elif op == "compute" and todo:
            req = data.draw(st.sampled_from(todo))
            sim.run(req, data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens)))
        elif op == "append" and done:
            req = data.draw(st.sampled_from(done))
            req.append_token(data.draw(ALPHABET))
            sim.run(req, 1)  # on failure the token stays uncomputed, for "compute" to retry
        elif op == "fork" and done:
            sim.fork(data.draw(st.sampled_from(done)))
        elif op == "free" and live:
            sim.free(sim.live[data.draw(st.sampled_from(live))])
        elif op == "preempt" and live:
            sim.preempt(sim.live[data.draw(st.sampled_from(live))])
        sim.check()

    for rid in sorted(sim.live):
        sim.free(sim.live[rid])
        sim.check()
    for req in sim.waiting:
        sim.kv.free(req)
    assert sim.kv.pool.num_free == num_blocks
    assert not any(sim.kv.pool.ref_cnt)
    assert sim.kv.tables == {}
    assert sim.kv.pending_copies == []
    sim.kv.check_consistency()


def test_property_workload_really_hits_the_cache_and_copies() -> None:
    """The random workload is only a good test if hits and copies-on-write happen in it."""
    sim = Sim(num_blocks=12, block_size=2, caching=True)
    first = sim.new_sequence([0, 1, 2, 0, 1])
    sim.admit(first, chunk=5)
    sim.check()
    second = sim.new_sequence([0, 1, 2, 0, 2, 2])
    sim.admit(second, chunk=16)
    sim.check()
    assert sim.kv.tables[second.seq_id][:2] == sim.kv.tables[first.seq_id][:2]
    assert sim.num_hit_blocks == 2
    sim.fork(first)
    first.append_token(1)
    sim.run(first, 1)
    sim.check()
    assert sim.num_copies == 1


# ----------------------------------------------------------------- prefix-cache hits


def test_a_repeated_prompt_hits_every_full_block_but_the_one_with_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    tokens = list(range(8))
    first = make_sequence("a", tokens)
    table = kv.allocate_slots(first, 8)
    assert table is not None and table == kv.block_table(first) and len(table) == 2
    first.num_computed_tokens = 8
    # 8 tokens = 2 full blocks, but the second holds the last token: only 1 block is served.
    again = make_sequence("b", tokens)
    hits = kv.get_computed_blocks(again)
    assert hits == kv.tables["a"][:1]
    # One more token: both full blocks are served.
    longer = make_sequence("c", tokens + [99])
    assert kv.get_computed_blocks(longer) == kv.tables["a"][:2]
    # Same second block but a different first block: the chained hash misses from the start.
    other = make_sequence("d", [7, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.get_computed_blocks(other) == []


def test_hits_survive_the_owner_finishing_and_are_revived_from_the_free_pool() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    first = make_sequence("a", list(range(9)))
    assert kv.allocate_slots(first, 9) is not None
    full_blocks = kv.tables["a"][:2]
    kv.free(first)
    assert kv.pool.num_free == 4
    second = make_sequence("b", list(range(8)) + [50, 51])
    hits = kv.get_computed_blocks(second)
    assert hits == full_blocks
    second.num_computed_tokens = 0
    assert kv.allocate_slots(second, 2, hits) is not None
    assert kv.tables["b"][:2] == full_blocks
    assert [kv.pool.ref_cnt[b] for b in full_blocks] == [1, 1]
    assert kv.pool.num_free == 1
    kv.check_consistency()


def test_revived_blocks_count_against_the_free_pool() -> None:
    """Taking a cached free block uses up a free block: admission must account for it."""
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_caching=True)
    first = make_sequence("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(first, 5) is not None
    kv.free(first)
    second = make_sequence("b", [1, 2, 3, 4, 9, 9, 9])
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 2
    # 2 revived + 2 new blocks for the 3 remaining tokens > 3 free blocks.
    assert kv.allocate_slots(second, 3, hits) is None
    assert kv.pool.num_free == 3
    assert not any(kv.pool.ref_cnt)
    assert kv.allocate_slots(second, 2, hits) is not None
    kv.check_consistency()


def test_no_hits_when_caching_is_off_or_prompt_logprobs_are_wanted() -> None:
    for caching, params in ((False, SamplingParams()), (True, SamplingParams(prompt_logprobs=1))):
        kv = KVCacheManager(num_blocks=10, block_size=2, enable_caching=caching)
        first = make_sequence("a", list(range(9)))
        assert kv.allocate_slots(first, 9) is not None
        assert kv.get_computed_blocks(make_sequence("b", list(range(9)), params)) == []


# ----------------------------------------------------------------- forks and copy-on-write


def forked_pair(
    prompt_len: int, num_blocks: int = 8, block_size: int = 4
) -> tuple[KVCacheManager, Sequence, Sequence]:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    parent = make_sequence("p", list(range(prompt_len)))
    assert kv.allocate_slots(parent, prompt_len) is not None
    parent.num_computed_tokens = prompt_len
    child = make_sequence("p#1", list(range(prompt_len)))
    kv.fork(parent, child)
    child.num_computed_tokens = prompt_len
    return kv, parent, child


def test_writing_into_a_shared_partial_block_copies_it_for_the_writer() -> None:
    kv, parent, child = forked_pair(prompt_len=6)
    full, partial = kv.tables["p"]
    assert kv.tables["p#1"] == [full, partial]
    assert [kv.pool.ref_cnt[b] for b in (full, partial)] == [2, 2]

    parent.append_token(100)
    assert kv.allocate_slots(parent, 1) is not None
    (copy,) = kv.take_pending_copies()
    private = kv.tables["p"][1]
    assert copy == (partial, private)
    assert private not in (full, partial)
    assert kv.tables["p"] == [full, private]
    assert kv.tables["p#1"] == [full, partial]
    assert [kv.pool.ref_cnt[b] for b in (full, partial, private)] == [2, 1, 1]
    kv.check_consistency()

    # The sibling is now the only holder of the old block: it writes in place, no copy.
    child.append_token(200)
    assert kv.allocate_slots(child, 1) is not None
    assert kv.take_pending_copies() == []
    assert kv.tables["p#1"] == [full, partial]

    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 8


def test_a_fork_on_a_block_boundary_needs_no_copy() -> None:
    kv, parent, _child = forked_pair(prompt_len=8)
    parent.append_token(100)
    assert kv.allocate_slots(parent, 1) is not None
    assert kv.take_pending_copies() == []
    assert kv.tables["p"][:2] == kv.tables["p#1"]
    assert len(kv.tables["p"]) == 3


def test_copy_on_write_without_a_free_block_fails_and_changes_nothing() -> None:
    kv, parent, _ = forked_pair(prompt_len=6, num_blocks=2)
    assert kv.pool.num_free == 0
    parent.append_token(100)
    tables = {rid: list(t) for rid, t in kv.tables.items()}
    assert kv.allocate_slots(parent, 1) is None
    assert kv.tables == tables
    assert kv.pending_copies == []
    kv.check_consistency()


def test_a_forked_child_registers_its_own_full_blocks() -> None:
    """After the copy, each sibling's block fills with its own tokens and is cached under them."""
    kv, parent, child = forked_pair(prompt_len=7)
    parent.append_token(100)
    assert kv.allocate_slots(parent, 1) is not None
    child.append_token(200)
    assert kv.allocate_slots(child, 1) is not None
    kv.take_pending_copies()
    for req in (parent, child):
        probe = make_sequence("probe-" + req.seq_id, req.all_token_ids + [0])
        assert kv.get_computed_blocks(probe) == kv.tables[req.seq_id]


@pytest.mark.parametrize("caching", [True, False])
def test_free_returns_every_block(caching: bool) -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=caching)
    reqs = [make_sequence(str(i), [i] * n) for i, n in enumerate((3, 4, 4))]  # 2 + 2 + 2 blocks
    for req in reqs:
        assert kv.allocate_slots(req, req.num_tokens) is not None
    assert kv.pool.num_free == 0
    for req in reqs:
        kv.free(req)
    assert kv.pool.num_free == 6
    assert kv.tables == {}


# ----------------------------------------------------------------- with a real model

BLOCK = 16


def make_engine(model_dir: Path, caching: bool) -> LLMEngine:
    # A budget large enough for a whole prompt in one step, so tables can be read after it.
    return LLM(
        model=str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=32,
        max_model_len=256,
        max_num_batched_tokens=256,
        enable_prefix_caching=caching,
    ).engine


def prefill(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[str, list[int]]:
    """Add a request and run its prompt step; its block table right after."""
    request_id = engine.add_request(prompt, params)
    engine.step()
    return request_id, list(engine.kv.tables[request_id])


def prompt_kv(engine: LLMEngine, table: list[int], length: int) -> list[torch.Tensor]:
    """Every layer's K and V for the first `length` positions, read through a block table."""
    return [
        cache[table].flatten(0, 1)[:length].clone()
        for layer in engine.executor.runner.kv_caches
        for cache in layer
    ]


def test_a_prefix_cache_hit_serves_the_kv_that_recomputation_gives(qwen3_dir: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(100, 5000, (4 * BLOCK,), generator=gen).tolist()
    # Shares 3 full blocks with `first`, then goes its own way.
    second = first[: 3 * BLOCK] + torch.randint(100, 5000, (13,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    cached = make_engine(qwen3_dir, caching=True)
    _first_id, first_table = prefill(cached, first, params)
    finish_all(cached)
    assert cached.kv.pool.num_free == 32  # first's blocks are free now, but still cached
    second_id, second_table = prefill(cached, second, params)
    assert cached.scheduler.counters.prefix_cache_hits == 3 * BLOCK
    assert second_table[:3] == first_table[:3]
    served = prompt_kv(cached, second_table, len(second))
    cached_tokens = finish_all(cached)[second_id]

    fresh = make_engine(qwen3_dir, caching=False)
    fresh_id, fresh_table = prefill(fresh, second, params)
    assert fresh.scheduler.counters.prefix_cache_hits == 0
    recomputed = prompt_kv(fresh, fresh_table, len(second))
    fresh_tokens = finish_all(fresh)[fresh_id]

    # The cached blocks, and the blocks computed on top of them, hold the same K/V as a run
    # that computed the whole prompt itself: the first layer's bitwise; later layers' to float32
    # rounding, as the 13-row chunk's attention (the CPU kernel) and the whole prompt's (SDPA)
    # add in different orders. A wrong block would differ by the values' own size.
    layer0 = 2  # K and V of layer 0
    for i, (got, want) in enumerate(zip(served, recomputed, strict=True)):
        if i < layer0:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(cached_tokens) == 6
    assert cached_tokens == fresh_tokens
    for engine in (cached, fresh):
        assert engine.kv.pool.num_free == 32


def test_blocks_behind_every_layers_window_go_back_to_the_pool() -> None:
    """Window 10, blocks of 4: the step whose first query is at position p needs keys from
    p - 9 on, so blocks wholly before that are released (and stay cached by their hash)."""
    from engine.core.kv_cache_manager import SLID_PAST

    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, sliding_window=10)
    seq = make_sequence("a", list(range(40)))
    assert kv.allocate_slots(seq, 12) is not None  # prefill 0..11: nothing before position 0 - 9
    assert kv.block_table(seq).count(SLID_PAST) == 0
    seq.num_computed_tokens = 12
    assert (
        kv.allocate_slots(seq, 8) is not None
    )  # rows 12..19 reach back to 3: block 0 (0..3) is needed
    assert kv.block_table(seq).count(SLID_PAST) == 0 and kv.pool.num_free == 11
    seq.num_computed_tokens = 20
    assert (
        kv.allocate_slots(seq, 4) is not None
    )  # rows 20..23 reach back to 11: blocks 0, 1 (0..7) go
    table = kv.block_table(seq)
    assert table[:2] == [SLID_PAST, SLID_PAST] and SLID_PAST not in table[2:]
    assert kv.pool.num_free == 16 - 4  # 6 blocks of the table, 2 released
    kv.check_consistency()
    # A new prompt with the same first 8 tokens still finds the released blocks by their hash.
    other = make_sequence("b", list(range(9)))
    assert len(kv.get_computed_blocks(other)) == 2
    kv.free(seq)
    assert kv.pool.num_free == 16
    kv.check_consistency()


def test_no_block_is_released_while_a_layer_attends_to_everything() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, sliding_window=None)
    seq = make_sequence("a", list(range(40)))
    assert kv.allocate_slots(seq, 32) is not None
    seq.num_computed_tokens = 32
    assert kv.allocate_slots(seq, 1) is not None
    assert min(kv.block_table(seq)) >= 0 and kv.pool.num_free == 16 - 9
