"""Scheduler over a real KVCacheManager, with no model: the step loop is simulated.

Each simulated step hands the scheduler's `update_from_output` a fake sampled token for every
sequence that samples (it advances `num_computed_tokens`, forks n > 1 siblings, appends the
tokens and finishes sequences at max_tokens, as in the engine). A shadow of the KV slots checks that the tables and block copies the scheduler
hands out would make every sequence read back its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler, rank
from engine.core.scheduler_output import Sample, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 10_000


@dataclass
class Sim:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    caching: bool = True
    policy: str = "fcfs"
    kv: KVCacheManager = field(init=False)
    sched: Scheduler = field(init=False)
    slots: list[list[int | None]] = field(init=False)
    max_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[Sequence] = field(default_factory=list)
    steps: int = 0
    # Which scheduled requests sampled in the last step (`samples_token` is only meaningful before
    # num_computed_tokens advances).
    sampled: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, self.block_size, self.caching)
        config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.policy,
        )
        self.sched = Scheduler(config, self.kv)
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, n: int = 1, priority: int = 0
    ) -> Sequence:
        """Queue a request the way the engine does: sample 0 waits, its siblings await the fork.
        Requests arrive in the order they are added."""
        params = SamplingParams(n=n, max_tokens=max_tokens)
        arrival = float(len(self.max_tokens))
        seqs = [
            Sequence(
                request_id if i == 0 else f"{request_id}#{i}",
                request_id,
                i,
                list(prompt),
                params,
                arrival,
                priority=priority,
                status=SequenceStatus.WAITING if i == 0 else SequenceStatus.AWAITING_FORK,
            )
            for i in range(n)
        ]
        seqs[0].forks = seqs[1:]
        for seq in seqs:
            self.max_tokens[seq.seq_id] = max_tokens
        self.sched.add(seqs[0])
        return seqs[0]

    def step(self) -> SchedulerOutput:
        sched = self.sched
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = sched.schedule()
        self.steps += 1
        self.check_schedule(out, running_before, waiting_before)

        # The forward pass: block copies first, then every scheduled token's K/V.
        for src, dst in out.block_copies:
            self.slots[dst] = list(self.slots[src])
        bs = self.block_size
        for s in out.scheduled:
            req = s.seq
            for p in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
                self.slots[s.block_table[p // bs]][p % bs] = req.all_token_ids[p]

        self.sampled = [s.samples_token for s in out.scheduled]
        # Siblings sample different tokens, so their blocks must really diverge.
        samples = [Sample((seq.num_tokens * 7 + seq.index) % 5, None) for seq in out.samplers]
        sched.update_from_output(out, samples, MAX_MODEL_LEN)
        self.finished += [seq for seq in out.samplers if seq.is_finished]
        assert all(seq.num_output_tokens == self.max_tokens[seq.seq_id] for seq in self.finished), (
            "finished before max_tokens, or after"
        )
        assert len(sched.running) <= self.max_num_seqs
        self.check_contents()
        return out

    def check_schedule(
        self, out: SchedulerOutput, running_before: list[Sequence], waiting_before: list[Sequence]
    ) -> None:
        sched = self.sched
        if self.policy == "priority":  # served, and preempted, in (priority, arrival) order
            running_before = sorted(running_before, key=rank)
            assert list(sched.waiting) == sorted(sched.waiting, key=rank)
        assert out.num_tokens <= self.max_num_batched_tokens
        assert len(sched.running) <= self.max_num_seqs
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)

        # Running requests first (in running order), then admissions from the head of the queue.
        running_ids = [r.seq_id for r in running_before]
        k = sum(1 for rid in ids if rid in running_ids)
        assert ids[:k] == [rid for rid in running_ids if rid in ids[:k]]
        admitted = ids[k:]
        assert admitted == [r.seq_id for r in waiting_before[: len(admitted)]], (
            "admission out of FCFS order"
        )

        if out.preempted:
            # The most recently admitted requests are the victims; nothing new comes in.
            victims = [r.seq_id for r in out.preempted]
            if self.policy == "fcfs":
                assert admitted == []
            else:  # room made for more urgent arrivals, which start in the same step
                assert all(
                    rank(sched_seq(sched, a)) < rank(v) for a in admitted for v in out.preempted
                )
            assert victims == running_ids[::-1][: len(victims)]
            if self.policy == "fcfs":
                assert [r.seq_id for r in list(sched.waiting)[: len(victims)]] == victims[::-1]
            for victim in out.preempted:
                assert victim.num_computed_tokens == 0
                assert victim.status == SequenceStatus.WAITING
                assert victim.seq_id not in ids
                assert not self.kv.block_table(victim)
        else:
            # A running request is skipped only when the budget is spent.
            if k < len(running_before):
                assert out.num_tokens == self.max_num_batched_tokens

        for s in out.scheduled:
            req = s.seq
            assert s.block_table == self.kv.tables[req.seq_id]
            assert (
                len(s.block_table) * self.block_size >= req.num_computed_tokens + s.num_new_tokens
            )
            assert req.num_computed_tokens + s.num_new_tokens <= req.num_tokens
            assert req.status == SequenceStatus.RUNNING
        self.kv.check_consistency()

    def check_contents(self) -> None:
        bs = self.block_size
        for req in self.sched.running:
            table = self.kv.tables[req.seq_id]
            seen = [self.slots[table[p // bs]][p % bs] for p in range(req.num_computed_tokens)]
            assert seen == req.all_token_ids[: req.num_computed_tokens], (
                f"{req.seq_id} reads wrong K/V"
            )

    def run_to_completion(self, max_steps: int = 2000) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "no progress"
            self.step()
        self.check_all_free()

    def check_all_free(self) -> None:
        assert self.kv.pool.num_free == self.num_blocks
        assert not any(self.kv.pool.ref_cnt)
        assert not any(self.kv.tables.values())
        self.kv.check_consistency()


def sched_seq(sched: Scheduler, seq_id: str) -> Sequence:
    return next(s for s in sched.running if s.seq_id == seq_id)


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


# ----------------------------------------------------------------- random workloads


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Sim, list[tuple[int, list[int], int, int, int]]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 6),  # the step it arrives at
                st.lists(st.integers(0, 2), min_size=1, max_size=20),  # prompt
                st.integers(1, 6),  # max_tokens
                st.integers(1, 3),  # n
                st.integers(-2, 2),  # priority (read under the priority policy)
            ),
            min_size=1,
            max_size=8,
        )
    )
    longest = max(len(p) + m for _, p, m, *_ in requests)
    # The pool always holds one sequence of the longest length, and sometimes little more.
    num_blocks = -(-longest // block_size) + draw(st.integers(0, 8))
    max_n = max(n for *_, n, _ in requests)
    sim = Sim(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(max_n, 6)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    return sim, sorted(requests, key=lambda r: r[0])


@settings(max_examples=150, deadline=None)
@given(workload=workloads())
def test_random_workloads_respect_every_limit_and_finish(
    workload: tuple[Sim, list[tuple[int, list[int], int, int, int]]],
) -> None:
    sim, requests = workload
    pending = list(enumerate(requests))
    while pending or sim.sched.has_unfinished():
        assert sim.steps < 3000, "no progress"
        while pending and pending[0][1][0] <= sim.steps:
            i, (_, prompt, max_tokens, n, priority) = pending.pop(0)
            sim.add(f"g{i}", prompt, max_tokens, n, priority)
        sim.step()
    sim.check_all_free()
    # Every sequence of every group produced exactly max_tokens tokens.
    assert sorted(r.seq_id for r in sim.finished) == sorted(sim.max_tokens)
    for req in sim.finished:
        assert req.num_output_tokens == sim.max_tokens[req.seq_id]
        assert req.status == SequenceStatus.FINISHED


# ----------------------------------------------------------------- targeted behaviour


def test_a_long_prompt_is_chunked_to_the_budget() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    req = sim.add("a", list(range(20)), max_tokens=2)
    out = sim.step()
    assert scheduled(out) == [("a", 8)] and sim.sampled == [False]
    assert len(sim.kv.tables["a"]) == 2 and req.num_output_tokens == 0
    out = sim.step()
    assert scheduled(out) == [("a", 8)] and sim.sampled == [False]
    out = sim.step()
    assert scheduled(out) == [("a", 4)] and sim.sampled == [True]
    assert req.num_output_tokens == 1 and len(sim.kv.tables["a"]) == 5
    out = sim.step()
    assert scheduled(out) == [("a", 1)]
    sim.run_to_completion()
    assert req.num_output_tokens == 2


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    sim.add("a", [1, 2, 3, 4], max_tokens=5)
    assert scheduled(sim.step()) == [("a", 4)]
    sim.add("b", list(range(10)), max_tokens=1)
    # a's decode token comes first; b gets what is left of the budget.
    assert scheduled(sim.step()) == [("a", 1), ("b", 3)]
    assert scheduled(sim.step()) == [("a", 1), ("b", 3)]
    assert scheduled(sim.step()) == [("a", 1), ("b", 3)]
    assert scheduled(sim.step()) == [("a", 1), ("b", 1)]
    sim.run_to_completion()


def test_a_waiting_request_never_overtakes_the_head_of_the_queue() -> None:
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    sim.add("a", list(range(8)), max_tokens=3)
    assert scheduled(sim.step()) == [("a", 8)]
    sim.add("b", list(range(100, 112)), max_tokens=1)  # 3 blocks: cannot fit while a runs
    sim.add("c", [1, 2], max_tokens=1)  # 1 block: would fit, but b is ahead
    out = sim.step()
    assert scheduled(out) == [("a", 1)]
    assert [r.seq_id for r in sim.sched.waiting] == ["b", "c"]
    assert sim.kv.pool.num_free == 1
    sim.run_to_completion()
    order = [r.seq_id for r in sim.finished]
    assert order.index("b") < order.index("c")


def test_max_num_seqs_bounds_the_running_set() -> None:
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        sim.add(name, [1, 2, 3], max_tokens=2 if name == "a" else 4)
    assert scheduled(sim.step()) == [("a", 3), ("b", 3)]
    out = sim.step()  # a finishes here
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert [r.seq_id for r in sim.sched.running] == ["b"]
    assert scheduled(sim.step()) == [("b", 1), ("c", 3)]
    sim.run_to_completion()


def test_forked_siblings_keep_their_reserved_seats() -> None:
    """A request with n = 3 reserves 3 seats at admission; while its prompt is still being
    chunked, a later request must not take one of them."""
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=4)
    sim.add("p", list(range(10)), max_tokens=2, n=3)
    sim.add("q", [1, 2], max_tokens=1)
    for _ in range(3):
        out = sim.step()
        assert [s.seq.seq_id for s in out.scheduled] == ["p"]
    # p's prompt is done and its siblings have forked: 3 sequences run, q still waits.
    assert [r.seq_id for r in sim.sched.running] == ["p", "p#1", "p#2"]
    assert [r.seq_id for r in sim.sched.waiting] == ["q"]
    sim.run_to_completion()


def test_preemption_evicts_the_most_recent_request_and_admits_nothing_that_step() -> None:
    # Without prefix caching, so that b's readmission needs exactly one block.
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=4, caching=False)
    a = sim.add("a", [1, 2, 3, 4], max_tokens=8)
    b = sim.add("b", [5, 6, 7, 8], max_tokens=8)
    assert scheduled(sim.step()) == [("a", 4)]  # a: 1 block
    assert scheduled(sim.step()) == [("a", 1), ("b", 3)]  # a: 2 blocks, b: 1 block
    assert scheduled(sim.step()) == [("a", 1), ("b", 1)]
    assert scheduled(sim.step()) == [("a", 1), ("b", 1)]  # b: 2 blocks, pool empty
    assert scheduled(sim.step()) == [("a", 1), ("b", 1)]
    assert sim.kv.pool.num_free == 0
    assert (a.num_tokens, b.num_tokens) == (9, 7)
    b_outputs = list(b.output_token_ids)

    # a's 9th token needs a 3rd block: b, admitted last, is preempted to make room.
    out = sim.step()
    assert [r.seq_id for r in out.preempted] == ["b"]
    assert scheduled(out) == [("a", 1)]
    assert sim.sched.counters.num_preemptions == 1 and b.num_preemptions == 1
    assert sim.sched.counters.preemptions_by_reason == {"kv_cache": 1}
    assert b.num_computed_tokens == 0 and b.status == SequenceStatus.WAITING
    assert b.output_token_ids == b_outputs  # its tokens are kept, only their K/V is recomputed
    assert list(sim.sched.waiting) == [b]
    # b's next 3-token chunk would fit in the free block, but nothing is admitted this step.
    assert sim.kv.pool.num_free == 1
    assert [r.seq_id for r in sim.sched.running] == ["a"]

    out = sim.step()
    assert scheduled(out) == [("a", 1), ("b", 3)]
    sim.run_to_completion()
    assert b.output_token_ids[: len(b_outputs)] == b_outputs
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_priority_admits_the_most_urgent_first_and_equals_in_arrival_order() -> None:
    sim = Sim(
        num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, policy="priority"
    )
    for name, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        sim.add(name, [1, 2, 3], max_tokens=2, priority=priority)
    sim.run_to_completion()
    assert [s.seq_id for s in sim.finished] == ["e", "b", "d", "c", "a"]


def test_fcfs_ignores_priority() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    for name, priority in [("a", 2), ("b", 0), ("c", 1)]:
        sim.add(name, [1, 2, 3], max_tokens=2, priority=priority)
    sim.run_to_completion()
    assert [s.seq_id for s in sim.finished] == ["a", "b", "c"]


def test_priority_preempts_the_least_urgent_running_request_not_the_latest() -> None:
    """The preemption scenario above with a admitted first but less urgent: a is the victim,
    and b (admitted later, more urgent) keeps running."""
    sim = Sim(
        num_blocks=4,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=4,
        caching=False,
        policy="priority",
    )
    a = sim.add("a", [1, 2, 3, 4], max_tokens=8, priority=1)
    assert scheduled(sim.step()) == [("a", 4)]
    b = sim.add("b", [5, 6, 7, 8], max_tokens=8, priority=0)
    # b is served first from now on: the budget goes to the most urgent running request.
    assert scheduled(sim.step()) == [("a", 1), ("b", 3)]
    assert scheduled(sim.step()) == [("b", 1), ("a", 1)]
    out = sim.step()
    while not out.preempted:  # until the pool runs out: a, then b, each wants a third block
        assert sim.steps < 20
        out = sim.step()
    assert out.preempted == [a] and a.num_tokens == 9 and b.num_tokens < 9
    assert a.status == SequenceStatus.WAITING and list(sim.sched.waiting) == [a]
    assert [s.seq_id for s in sim.sched.running] == ["b"]
    sim.run_to_completion()
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert [s.seq_id for s in sim.finished] == ["b", "a"]


def test_an_urgent_arrival_takes_the_place_of_a_less_urgent_running_request() -> None:
    """The pool is held by a low-priority request; a more urgent one arrives and starts in the
    very next step, its predecessor preempted (to finish later with all its tokens). An arrival
    of the same priority waits instead."""
    sim = Sim(
        num_blocks=3,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        caching=False,
        policy="priority",
    )
    low = sim.add("low", list(range(9)), max_tokens=3, priority=5)
    assert scheduled(sim.step()) == [("low", 9)]  # all 3 blocks
    same = sim.add("same", [1, 2, 3], max_tokens=2, priority=5)
    out = sim.step()
    assert out.preempted == [] and scheduled(out) == [("low", 1)]
    urgent = sim.add("urgent", [4, 5, 6], max_tokens=2, priority=0)
    out = sim.step()
    assert out.preempted == [low]
    assert sim.sched.counters.preemptions_by_reason == {"priority": 1}
    assert low.kv_wait_since is not None  # waiting for room again, from now on
    assert scheduled(out) == [("urgent", 3)]
    assert [s.seq_id for s in sim.sched.waiting] == ["low", "same"]  # by (priority, arrival)
    sim.run_to_completion()
    assert low.kv_wait_since is None and low.kv_wait > 0  # readmitted: its wait is counted
    assert sim.finished[0].seq_id == "urgent"
    assert (low.num_output_tokens, same.num_output_tokens, urgent.num_output_tokens) == (3, 2, 2)


def test_a_request_preempted_for_an_urgent_one_does_not_restart_in_the_same_step() -> None:
    """The victim frees more than the arrival needs and budget is left over: it still waits a
    step, rather than redoing its prompt from nothing with the room just made for another."""
    sim = Sim(
        num_blocks=10,
        block_size=1,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        caching=False,
        policy="priority",
    )
    low = sim.add("low", list(range(8)), max_tokens=2, priority=5)
    assert scheduled(sim.step()) == [("low", 8)]  # 8 of the 10 blocks
    sim.add("urgent", [1, 2, 3], max_tokens=2, priority=0)  # needs 3 blocks, 2 are free
    out = sim.step()
    assert out.preempted == [low]
    assert scheduled(out) == [("urgent", 3)]  # 5 tokens of budget and 7 blocks left unused
    assert list(sim.sched.waiting) == [low]
    sim.run_to_completion()
    assert low.num_output_tokens == 2


def test_room_made_for_an_urgent_request_is_not_taken_by_an_equal_of_its_victim() -> None:
    """A forked pair holds the pool; an urgent arrival first preempts one sibling (not room
    enough: the siblings share their prompt block), then the other. The first sibling, waiting
    behind the arrival and as urgent as the one just preempted, must not start in the room made
    for the arrival (it would take the place of its equal and redo its work)."""
    sim = Sim(
        num_blocks=5,
        block_size=1,
        max_num_seqs=2,
        max_num_batched_tokens=4,
        caching=False,
        policy="priority",
    )
    first = sim.add("pair", [0], max_tokens=4, n=2)
    sim.step()
    sim.step()
    sim.add("urgent", [0, 0, 0], max_tokens=1, priority=-1)
    out = sim.step()
    assert [s.seq_id for s in out.preempted] == ["pair#1"] and scheduled(out) == [("pair", 1)]
    out = sim.step()
    assert out.preempted == [first]
    assert scheduled(out) == [("urgent", 3)]  # and not pair#1 with the budget's last token
    sim.run_to_completion()
    assert sorted(s.seq_id for s in sim.finished) == ["pair", "pair#1", "urgent"]


def test_no_room_is_made_when_the_arrival_could_not_start_anyway() -> None:
    sim = Sim(
        num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, policy="priority"
    )
    sim.add("low", list(range(9)), max_tokens=3, priority=5)
    sim.step()
    sim.add("huge", list(range(20)), max_tokens=1, priority=0)  # 6 blocks: more than the pool
    out = sim.step()
    assert out.preempted == [] and scheduled(out) == [("low", 1)]


def test_the_last_running_request_preempts_itself_when_nothing_is_left_to_free() -> None:
    sim = Sim(num_blocks=3, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    a = sim.add("a", [1, 2], max_tokens=3)
    b = sim.add("b", [3, 4], max_tokens=3)
    assert scheduled(sim.step()) == [("a", 2), ("b", 2)]  # 1 block each, 1 left
    # a takes the last block for its 3rd token; b then needs one and is itself the victim.
    out = sim.step()
    assert out.preempted == [b]
    assert scheduled(out) == [("a", 1)]
    assert list(sim.sched.waiting) == [b] and b.num_computed_tokens == 0
    sim.run_to_completion()
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3


def test_prefix_cache_hits_are_counted_and_skip_computation() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(9))
    sim.add("a", prompt, max_tokens=1)
    sim.run_to_completion()
    assert (sim.sched.counters.prefix_cache_queries, sim.sched.counters.prefix_cache_hits) == (9, 0)
    b = sim.add("b", prompt, max_tokens=1)
    out = sim.step()
    # 2 full blocks come from the cache; only the last token is computed.
    assert scheduled(out) == [("b", 1)]
    assert b.num_cached_tokens == 8
    assert (sim.sched.counters.prefix_cache_queries, sim.sched.counters.prefix_cache_hits) == (
        18,
        8,
    )
    sim.run_to_completion()


def test_a_recompute_after_preemption_keeps_the_cache_hit_of_the_first_admission() -> None:
    """`num_cached_tokens` is what usage reports as cached: the hit when the request was first
    admitted. Readmitted after a preemption, the request finds its own first block in the cache;
    that recompute must not overwrite the count (nor be counted as a new query)."""
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    sim.add("a", [1, 2, 3, 4], max_tokens=8)
    b = sim.add("b", [5, 6, 7, 8], max_tokens=8)
    while not b.num_preemptions:
        sim.step()
    assert b.num_cached_tokens == 0 and b.num_tokens == 7
    queries = sim.sched.counters.prefix_cache_queries

    while b.status == SequenceStatus.WAITING:
        out = sim.step()
    # Its first block (its whole prompt, 4 tokens) came back from the cache this time.
    assert scheduled(out)[-1] == ("b", 3)
    assert b.num_cached_tokens == 0
    assert sim.sched.counters.prefix_cache_queries == queries
    sim.run_to_completion()


# ----------------------------------------------------------------- the post-step update alone


def scheduler_with(prompt: list[int], params: SamplingParams) -> tuple[Scheduler, Sequence]:
    """A scheduler (blocks of 4, a budget of 8) holding one request of `params.n` samples."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), kv)
    seqs = [
        Sequence(
            "r" if i == 0 else f"r#{i}",
            "r",
            i,
            list(prompt),
            params,
            0.0,
            eos_token_id=0,
            status=SequenceStatus.WAITING if i == 0 else SequenceStatus.AWAITING_FORK,
        )
        for i in range(params.n)
    ]
    seqs[0].forks = seqs[1:]
    sched.add(seqs[0])
    return sched, seqs[0]


def test_a_prompt_chunk_advances_the_computed_tokens_and_samples_nothing() -> None:
    sched, seq = scheduler_with(list(range(1, 11)), SamplingParams(max_tokens=4))
    out = sched.schedule()
    assert out.samplers == []
    sched.update_from_output(out, [], MAX_MODEL_LEN)
    assert seq.num_computed_tokens == 8 and seq.output_token_ids == []
    assert sched.running == [seq]


def test_the_last_prompt_chunk_forks_the_siblings_and_each_takes_its_own_token() -> None:
    sched, parent = scheduler_with(list(range(1, 7)), SamplingParams(n=3, max_tokens=4))
    children = list(parent.forks)
    out = sched.schedule()
    assert out.samplers == [parent, *children]
    assert sched.running == [parent]  # the siblings join only once the prompt is computed
    sched.update_from_output(out, [Sample(7, None), Sample(8, None), Sample(9, None)], 100)
    assert sched.running == [parent, *children] and parent.forks == []
    assert [s.output_token_ids for s in (parent, *children)] == [[7], [8], [9]]
    for child in children:
        assert child.status == SequenceStatus.RUNNING and child.num_computed_tokens == 6
        assert sched.kv.tables[child.seq_id] == sched.kv.tables[parent.seq_id]
    sched.kv.check_consistency()


def test_a_stop_token_finishes_the_sequence_and_returns_its_blocks() -> None:
    sched, seq = scheduler_with([1, 2, 3], SamplingParams(max_tokens=9, stop_token_ids=[5]))
    out = sched.schedule()
    assert sched.kv.pool.num_free == 15
    sched.update_from_output(out, [Sample(5, None)], MAX_MODEL_LEN)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 5)
    assert seq.is_finished and sched.running == [] and not sched.has_unfinished()
    assert sched.kv.pool.num_free == 16 and seq.seq_id not in sched.kv.tables


def test_eos_max_tokens_and_the_model_length_each_end_a_sequence() -> None:
    for params, token, max_model_len, reason in [
        (SamplingParams(max_tokens=9), 0, 100, "stop"),  # eos
        (SamplingParams(max_tokens=9, ignore_eos=True), 0, 100, None),
        (SamplingParams(max_tokens=1), 4, 100, "length"),
        (SamplingParams(max_tokens=9), 4, 4, "length"),  # 3 prompt tokens + 1 fill the model
    ]:
        sched, seq = scheduler_with([1, 2, 3], params)
        out = sched.schedule()
        sched.update_from_output(out, [Sample(token, None)], max_model_len)
        assert seq.finish_reason == reason, params
        assert seq.is_finished == (reason is not None)
        assert (sched.running == [seq]) == (reason is None)


def test_logprobs_are_kept_only_when_asked_for() -> None:
    logprobs: PositionLogprobs = {4: -0.5}
    for asked, want in [(None, None), (0, [logprobs])]:
        sched, seq = scheduler_with([1, 2, 3], SamplingParams(max_tokens=9, logprobs=asked))
        sched.update_from_output(sched.schedule(), [Sample(4, logprobs)], MAX_MODEL_LEN)
        assert seq.logprobs == want


def test_a_sample_missing_for_a_sampler_is_an_error_not_a_silent_skip() -> None:
    sched, _ = scheduler_with(list(range(1, 7)), SamplingParams(n=2, max_tokens=4))
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update_from_output(out, [Sample(7, None)], MAX_MODEL_LEN)
