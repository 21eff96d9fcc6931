"""The scheduler keeps at most --max-loras distinct adapters running: a request whose adapter
finds no slot holds the head of the queue (first come, first served) until a running adapter's
requests end, while requests of running adapters and of the base model are admitted as usual
before it; and a preempted request comes back with its adapter."""

from __future__ import annotations

from config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

ADAPTERS = [LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc")]


def _seq(seq_id: str, lora: LoRARequest | None, max_tokens: int = 3) -> Sequence:
    return Sequence(
        seq_id, seq_id, 0, [1, 2, 3], SamplingParams(max_tokens=max_tokens), 0.0, lora=lora
    )


def _running_adapters(sched: Scheduler) -> set[str]:
    return {s.lora.lora_name for s in sched.running if s.lora is not None}


def test_at_most_max_loras_adapters_run_and_the_queue_stays_fcfs() -> None:
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_loras=2)
    a, b, c = ADAPTERS
    for seq in (_seq("a1", a), _seq("base1", None), _seq("b1", b), _seq("a2", a), _seq("c1", c)):
        sched.add(seq)
    sched.add(_seq("base2", None))  # behind c1: FCFS, so it waits with it
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["a1", "base1", "b1", "a2"]
    assert [s.seq_id for s in sched.waiting] == ["c1", "base2"]
    assert _running_adapters(sched) == {"a", "b"}
    # b1 ends: c finds a slot, and base2 behind it starts too.
    (b1,) = [s for s in sched.running if s.seq_id == "b1"]
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    sched.finish(b1)
    out = sched.schedule()
    admitted = [s.seq.seq_id for s in out.scheduled if s.seq.num_computed_tokens == 0]
    assert admitted == ["c1", "base2"]
    assert _running_adapters(sched) == {"a", "c"} and not sched.waiting


def test_a_preempted_request_keeps_its_adapter() -> None:
    """Two blocks of 4 for two growing requests under two adapters: one is preempted, and it
    comes back, and stays, under its own adapter (never the other's)."""
    kv = KVCacheManager(2, 4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv, max_loras=2)
    a, b = ADAPTERS[0], ADAPTERS[1]
    first, second = _seq("a1", a, max_tokens=8), _seq("b1", b, max_tokens=8)
    sched.add(first)
    sched.add(second)
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += out.preempted
        for s in out.scheduled:
            assert s.seq.lora == (a if s.seq.seq_id == "a1" else b)
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.seq.num_computed_tokens == s.seq.num_tokens:
                s.seq.append_token(0)
    assert preempted
    for seq in [*preempted, *sched.running, *sched.waiting]:
        assert seq.lora == (a if seq.seq_id == "a1" else b), seq.seq_id


def test_an_urgent_request_takes_the_slot_of_a_less_urgent_adapter() -> None:
    """Priority policy, one slot: every running request of adapter a is less urgent than the
    head under b, so preempting them frees a's slot and b starts; one urgent request under a
    keeps the slot, and then b waits."""
    a, b = ADAPTERS[0], ADAPTERS[1]
    for urgent_a, admitted in ((False, ["b1"]), (True, [])):
        kv = KVCacheManager(64, 4, enable_caching=False)
        config = SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority"
        )
        sched = Scheduler(config, kv, max_loras=1)
        running = [_seq("a1", a), _seq("a2", a)]
        running[0].priority = -5 if urgent_a else 5
        running[1].priority = 5
        for seq in running:
            sched.add(seq)
        for s in sched.schedule().scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.append_token(0)  # decoding from now on
        head = _seq("b1", b)
        head.priority = 0
        sched.add(head)
        out = sched.schedule()
        assert [s.seq.seq_id for s in out.scheduled if s.seq is head] == admitted
        assert sorted(s.seq_id for s in out.preempted) == ([] if urgent_a else ["a1", "a2"])
        assert _running_adapters(sched) == ({"a"} if urgent_a else {"b"})
