"""One token budget per step, no separate prefill and decode phases.

Every running sequence advances its `num_computed_tokens` toward its token count (a prompt
chunk or one decode token), running sequences first, then waiting ones in arrival order, each
chunked to what the budget leaves. A pooling sequence is never chunked: it waits for a step
whose budget holds all of it (the engine admits none longer than the budget). When the pool
cannot hold a running sequence's next tokens, the most recently admitted sequence is preempted
(its blocks freed, recomputed later from the head of the queue), and nothing new is admitted
in that step.

Under the priority policy "arrival order" becomes "(priority, arrival) order" everywhere: the
queue is kept sorted by it, the running sequences are served in it, and the preempted one is
the last in it (the lowest priority, the latest of those). And a waiting sequence more urgent
than running ones takes their place when it could not start otherwise: they are preempted
before the step, and it is admitted in the same step (with any others more urgent than every
victim, never one only as urgent: it would take a victim's place back).
"""

from __future__ import annotations

import math
import time
from bisect import insort
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial

from config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request_failures import RequestFailures
from engine.core.scheduler_output import Sample, ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.stop_conditions import check_stop
from engine.multimodal.encoder_cache import EncoderCache, EncoderPlan


@dataclass
class SchedulerCounters:
    """What the scheduler counted since the counters were last taken."""

    num_preemptions: int = 0
    # kv_cache: a running sequence was short of blocks; priority: room for a more urgent one.
    preemptions_by_reason: Counter[str] = field(default_factory=Counter)
    prefix_cache_queries: int = 0  # in tokens, as the metrics count them
    prefix_cache_hits: int = 0
    # The KV offload tiers (vLLM's external prefix cache): prompt tokens of the sequences
    # that asked them, and tokens loaded from them.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


def rank(seq: Sequence) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return seq.priority, seq.arrival_time


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_loras: int | None = None,
        encoder: EncoderCache | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = max_loras  # distinct LoRA adapters running at once (their slots)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.by_priority = config.scheduling_policy == "priority"
        self.kv = kv
        # Image inputs: which encoder outputs are held, and each step's encoder budget (rows).
        self.encoder = encoder
        self._encoder_budget = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def add(self, seq: Sequence) -> None:
        self.kv.read_ahead(seq)  # while it waits, the disk tier's blocks of its prefix
        if self.by_priority:
            insort(self.waiting, seq, key=rank)  # after its equals: first come first served
        else:
            self.waiting.append(seq)

    def take_counters(self) -> SchedulerCounters:
        """The counts since the previous call; counting starts again from zero."""
        counters, self.counters = self.counters, SchedulerCounters()
        return counters

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._encoder_budget = 0 if self.encoder is None else self.encoder.capacity
        if self.by_priority:  # the budget goes first to, and preemption last to, the urgent
            self.running.sort(key=rank)
            self._make_room_for_the_most_urgent(out)
        made_room = len(out.preempted)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_planned_tokens - seq.num_planned_computed, budget)
            num_new, images = self._fit_images(seq, seq.num_planned_computed, num_new, out)
            if num_new == 0:  # a beam whose row is in, or a chunk waiting for the encoder
                i += 1
                continue
            drafts: list[int] = []
            if seq.spec_token_ids and seq.num_planned_tokens - seq.num_planned_computed == 1:
                drafts = seq.spec_token_ids[: budget - 1]  # the budget counts every verified row
                num_new += len(drafts)
            seq.spec_token_ids = []
            table = self.kv.allocate_slots(seq, num_new)
            if table is None and drafts:  # guesses never preempt anyone: the step goes without
                num_new -= len(drafts)
                drafts = []
                table = self.kv.allocate_slots(seq, num_new)
            while table is None:
                victim = self.running.pop()  # never one already scheduled: those come before i
                self._preempt(victim, "kv_cache")
                out.preempted.append(victim)
                if victim is seq:
                    break
                table = self.kv.allocate_slots(seq, num_new)
            else:
                out.scheduled.append(
                    ScheduledSequence(
                        seq, num_new, table, seq.num_planned_computed, draft_token_ids=drafts
                    )
                )
                self._commit_images(seq, images, out)
                budget -= num_new
                i += 1

        if len(out.preempted) == made_room:  # no running sequence was short of blocks
            # Room made for the urgent goes to sequences more urgent than every victim: one
            # only as urgent as a victim would take the victim's place back, recomputing.
            self._admit(budget, out, min((rank(v) for v in out.preempted), default=None))
        if not out.scheduled and self.running and self.waiting:
            self._unblock_beams(budget, out)
        for s in out.scheduled:
            seq = s.seq
            end = s.start + s.num_real_tokens
            if end == seq.num_planned_tokens:
                if seq.beam is None:
                    # Siblings fork at the prompt's end, not at a step planned after it (async
                    # scheduling plans one before the prompt's step has forked them).
                    s.samplers = [seq, *seq.forks] if end == seq.num_prompt_tokens else [seq]
                else:
                    s.beam_row = out.has_beam_rows = True
            # Planned until the step's results are applied (`update_from_output`), so that a
            # step scheduled before then (async scheduling) starts after this one.
            seq.num_inflight_tokens += s.num_new_tokens
            seq.num_pending_tokens += int(s.samples_token)
        out.block_copies = self.kv.take_pending_copies()
        if self.encoder is not None:
            out.encoder_evicted = self.encoder.take_evicted()
        return out

    def _fit_images(
        self, seq: Sequence, start: int, num_new: int, out: SchedulerOutput
    ) -> tuple[int, EncoderPlan | None]:
        """The chunk cut before the first image the encoder cannot take this step, and what
        the chunk needs of the encoder."""
        if self.encoder is None or seq.mm is None or start >= seq.num_prompt_tokens:
            return num_new, None
        planned = {item.hash for item in out.encoder_inputs}
        return self.encoder.plan(seq.mm, start, num_new, self._encoder_budget, planned)

    def _commit_images(self, seq: Sequence, plan: EncoderPlan | None, out: SchedulerOutput) -> None:
        if self.encoder is None or plan is None:
            return
        self.encoder.commit(seq.seq_id, plan)
        out.encoder_inputs.extend(plan.encode)
        self._encoder_budget -= sum(item.num_embeds for item in plan.encode)

    def unschedule(self, out: SchedulerOutput) -> None:
        """The step will not run: its sequences are planned as if it had not been scheduled
        (their blocks stay allocated, for the step that computes them)."""
        for s in out.scheduled:
            s.seq.num_inflight_tokens -= s.num_new_tokens
            s.seq.num_pending_tokens -= int(s.samples_token)
        if self.encoder is not None:
            self.encoder.drop(out.encoder_inputs)

    def _admit(
        self, budget: int, out: SchedulerOutput, below: tuple[int, float] | None = None
    ) -> None:
        """Start waiting sequences from the head of the queue while they fit; with `below`, only
        those whose rank is under it."""
        # A sequence preempted in this step starts again in a later one at the earliest: back in
        # now, it would redo its prompt from nothing with the room its preemption made for others.
        preempted_now = {id(s) for s in out.preempted}
        while (
            self.waiting
            and budget > 0
            and id(self.waiting[0]) not in preempted_now
            and (below is None or rank(self.waiting[0]) < below)
            and self._num_seqs_after_admitting(self.waiting[0]) <= self.max_num_seqs
            and self._adapter_fits(self.waiting[0])
        ):
            seq = self.waiting[0]
            if self.kv.tier_reads_pending(seq):
                if self.running or out.scheduled:
                    break  # the others step on: it is admitted once its blocks are read
                self.kv.wait_for_tier_reads(seq)  # nobody else to run: waiting holds up none
            hits = self.kv.get_computed_blocks(seq)  # a waiting sequence has nothing computed
            num_pool_hits = len(hits)
            hits, num_loaded = self.kv.load_offloaded(seq, hits, budget)
            if self.encoder is not None and seq.mm is not None:
                start = self.encoder.whole_span_start(seq.mm, len(hits) * self.kv.block_size)
                hits = hits[: start // self.kv.block_size]
            num_cached = len(hits) * self.kv.block_size
            num_external = min(num_loaded, max(0, len(hits) - num_pool_hits)) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if seq.pooling is not None and num_new < seq.num_tokens - num_cached:
                break  # pooled whole, never chunked: it waits for a step with room for all of it
            num_new, images = self._fit_images(seq, num_cached, num_new, out)
            if num_new == 0:
                break  # its first image waits for the encoder: nobody overtakes the head
            table = self.kv.allocate_slots(seq, num_new, hits)
            if table is None:
                if seq.kv_wait_since is None:
                    seq.kv_wait_since = time.time()
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.kv_wait_since is not None:
                seq.kv_wait += time.time() - seq.kv_wait_since
                seq.kv_wait_since = None
            if seq.num_preemptions == 0:
                self.counters.prefix_cache_queries += seq.num_tokens
                self.counters.prefix_cache_hits += num_cached - num_external
                if self.kv.offload is not None:
                    self.counters.external_prefix_cache_queries += seq.num_tokens
                    self.counters.external_prefix_cache_hits += num_external
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens += num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new, table, seq.num_computed_tokens))
            self._commit_images(seq, images, out)
            budget -= num_new

    def _unblock_beams(self, budget: int, out: SchedulerOutput) -> None:
        """Nothing could run: every running sequence is a beam waiting for a queued sibling,
        and the queue's head finds no room (two searches, each partly preempted, can hold the
        pool between them). The head and its own beam group go first: running sequences of
        other requests are preempted, from the back, until the head starts. The pool holds
        any one search whole, so it does by the time only its own group is left."""
        head = self.waiting[0]
        group = [s for s in self.waiting if s is head or (head.beam and s.beam is head.beam)]
        while self.running and not out.scheduled:
            others = [s for s in self.running if head.beam is None or s.beam is not head.beam]
            victim = others[-1] if others else self.running[-1]
            self.running.remove(victim)
            self._preempt(victim, "kv_cache")
            out.preempted.append(victim)
            # The victim queues behind the head's group, or it would take the room just made.
            self.waiting = deque([*group, *(s for s in self.waiting if s not in group)])
            self._admit(budget, out)

    def _make_room_for_the_most_urgent(self, out: SchedulerOutput) -> None:
        """Preempt the least urgent running sequences, all less urgent than the head of the queue,
        that the head needs gone to start now (a seat, and blocks for its first chunk); none if
        even all of them would not do."""
        if not self.waiting:
            return
        head = self.waiting[0]
        # The head's adapter finds no LoRA slot: a slot frees once every running sequence of
        # one adapter is among the victims.
        needs_slot = not self._adapter_fits(head)
        under = Counter(s.lora for s in self.running if s.lora is not None)
        seats = self._num_seqs_after_admitting(head) - self.max_num_seqs
        first_chunk = min(head.num_tokens, self.max_num_batched_tokens)
        blocks = math.ceil(first_chunk / self.kv.block_size) - self.kv.pool.num_free
        victims: list[Sequence] = []
        for seq in reversed(self.running):
            if seats <= 0 and blocks <= 0 and not needs_slot:
                break
            if rank(seq) <= rank(head):
                return  # the rest are at least as urgent: the head waits its turn
            victims.append(seq)
            seats -= 1 + len(seq.forks)
            blocks -= len(self.kv.block_table(seq))  # at most: shared blocks stay
            if seq.lora is not None:
                under[seq.lora] -= 1
                needs_slot = needs_slot and under[seq.lora] > 0
        if seats > 0 or blocks > 0 or needs_slot:
            return
        for victim in victims:
            self.running.remove(victim)
            self._preempt(victim, "priority")
            out.preempted.append(victim)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """A slot is free for the sequence's adapter, or it runs already: FCFS, so a request
        whose adapter finds no slot holds the queue until a running adapter's requests end."""
        if seq.lora is None or self.max_loras is None:
            return True
        running = {s.lora for s in self.running if s.lora is not None}
        return seq.lora in running or len(running) < self.max_loras

    def _num_seqs_after_admitting(self, seq: Sequence) -> int:
        # Forked siblings join the running set when the prompt completes, and a beam search
        # forks up to its width: their seats stay reserved from admission on, for the running
        # sequences' as for this one's.
        reserved = sum(len(r.forks) for r in self.running)
        groups = {id(s.beam): s.beam for s in (*self.running, seq) if s.beam is not None}
        reserved += sum(group.seats_to_come() for group in groups.values())
        return len(self.running) + reserved + 1 + len(seq.forks)

    def _preempt(self, seq: Sequence, reason: str) -> None:
        if seq.beam is not None:
            seq.beam.drop_row(seq)
        self.kv.free(seq)
        if self.encoder is not None and seq.mm is not None:
            self.encoder.release(seq.seq_id, seq.mm)
        seq.spec_token_ids = []
        # A step still running for it is discarded when it ends (async scheduling).
        seq.num_computed_tokens = seq.num_inflight_tokens = seq.num_pending_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.kv_wait_since = time.time()  # until readmitted, it waits for room in the pool
        self.counters.num_preemptions += 1
        self.counters.preemptions_by_reason[reason] += 1
        if self.by_priority:
            self.add(seq)  # its arrival puts it before the later arrivals of its priority
        else:
            self.waiting.appendleft(seq)

    def update_from_output(
        self,
        out: SchedulerOutput,
        samples: list[Sample | None],
        max_model_len: int,
        failures: RequestFailures | None = None,
    ) -> None:
        """Apply a step's results: every scheduled sequence's new tokens are computed; siblings
        fork from a prompt that completed; each sampler (in `out.samplers` order, one sample
        each) takes its token, and a token that ends its sequence finishes it (its blocks go
        back to the pool). Stop strings, found in the text, end a sequence later, by `finish`.
        A request in `failures` is left as it is (the engine ends it); one that fails here
        (its grammar refusing the token, say) joins them."""
        failures = failures if failures is not None else RequestFailures()
        for s in out.scheduled:
            if failures.failed(s.seq.request_id):
                continue
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.num_inflight_tokens -= s.num_new_tokens
            s.seq.num_pending_tokens -= int(s.samples_token)
            if self.encoder is not None and s.seq.mm is not None:
                self.encoder.passed(s.seq.seq_id, s.seq.mm, s.seq.num_computed_tokens)
            if s.seq.forks and s.samples_token:
                self._fork(s.seq)
        for seq, sample in zip(out.samplers, samples, strict=True):
            if sample is not None:
                failures.run(seq.request_id, partial(self.take, seq, sample, max_model_len))

    def take(self, seq: Sequence, sample: Sample, max_model_len: int) -> None:
        """The sequence takes a sampled token; one that ends it finishes it."""
        seq.append_token(sample.token_id)
        if seq.logprobs is not None and sample.logprobs is not None:
            seq.logprobs.append(sample.logprobs)
        check_stop(seq, sample.token_id, max_model_len)
        if seq.finish_reason is not None:
            self.finish(seq)

    def _fork(self, parent: Sequence) -> None:
        """Start the parent's siblings on its freshly computed prompt; each then samples its
        own first token from the parent's last row."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (and any unforked siblings)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if self.encoder is not None and seq.mm is not None:
            self.encoder.release(seq.seq_id, seq.mm)
        seq.status = SequenceStatus.FINISHED
