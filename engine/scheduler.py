"""One token budget per step, no separate prefill and decode phases.

Every running request advances its `num_computed_tokens` toward its token count (a prompt
chunk or one decode token), running requests first, then waiting ones in arrival order, each
chunked to what the budget leaves. When the pool cannot hold a running request's next tokens,
the most recently admitted request is preempted (its blocks freed, recomputed later from the
head of the queue), and nothing new is admitted in that step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # in tokens, as the metrics count them
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # never one already scheduled: those come before i
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                i += 1

        if not out.preempted:
            self._admit(budget, scheduled)

        by_id = {r.request_id: r for r in self.running}
        out.scheduled = [
            ScheduledRequest(by_id[rid], n, self.kv.block_table(by_id[rid]))
            for rid, n in scheduled.items()
        ]
        out.block_copies = self.kv.take_pending_copies()
        return out

    def _admit(self, budget: int, scheduled: dict[str, int]) -> None:
        while (
            self.waiting
            and budget > 0
            and self._num_seqs_after_admitting(self.waiting[0]) <= self.max_num_seqs
        ):
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)  # a waiting request has nothing computed
            num_cached = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
                request.num_cached_tokens = num_cached
            request.num_computed_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new

    def _num_seqs_after_admitting(self, request: Request) -> int:
        # Forked siblings join the running set when the prompt completes: their seats stay
        # reserved from admission on, for the running requests' siblings as for this one's.
        reserved = sum(len(r.forks) for r in self.running)
        return len(self.running) + reserved + 1 + len(request.forks)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def fork(self, parent: Request) -> list[Request]:
        """Start the parent's siblings on its freshly computed prompt (called after sampling the
        parent's first token; each sibling then samples its own)."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        return children

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks (and any unforked siblings)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
