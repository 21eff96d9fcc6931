"""Recording, on the engine thread, what the metrics are made of: each step's tokens, each
request's first scheduling, its tokens and its end, into the `EngineStats` that `take` hands
over (with the scheduler's counts and state) and starts afresh."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.processing.request import Request
from engine.stats import EngineStats, FinishedRequest


class StatsRecorder:
    def __init__(self) -> None:
        self.stats = EngineStats()

    def take(self, scheduler: Scheduler, with_adapters: bool) -> EngineStats:
        """What was recorded and what the scheduler counted since the previous call, with the
        running/waiting/KV state now; `with_adapters`: the adapters running and waiting too."""
        stats, self.stats = self.stats, EngineStats()
        counters = scheduler.take_counters()
        stats.num_preemptions = counters.num_preemptions
        stats.preemptions_by_reason = dict(counters.preemptions_by_reason)
        stats.prefix_cache_queries = counters.prefix_cache_queries
        stats.prefix_cache_hits = counters.prefix_cache_hits
        stats.external_prefix_cache_queries = counters.external_prefix_cache_queries
        stats.external_prefix_cache_hits = counters.external_prefix_cache_hits
        stats.num_running = len(scheduler.running)
        stats.num_waiting = len(scheduler.waiting)
        stats.kv_cache_usage = scheduler.kv.usage()
        stats.num_free_blocks = scheduler.kv.pool.num_free
        if with_adapters:
            stats.running_loras = _adapter_names(scheduler.running)
            stats.waiting_loras = _adapter_names(scheduler.waiting)
        return stats

    def scheduled(self, requests: Iterable[Request], num_tokens: int, now: float) -> None:
        """A step of `num_tokens` tokens runs these requests."""
        self.stats.iteration_tokens.append(num_tokens)
        for request in requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def token(self, request: Request, seq: Sequence, now: float, count: int = 1) -> None:
        """`seq` of `request` generated a token (a beam search: `count`, one a live beam)."""
        stats = self.stats
        stats.generation_tokens += count
        if request.first_token_time is None:
            request.first_token_time = now
            stats.time_to_first_token.append(now - request.arrival_time)
            stats.prompt_tokens += len(request.prompt_token_ids)
        elif seq.last_token_time is not None:  # a fork's first token is not a gap
            stats.inter_token_latency.append(now - seq.last_token_time)
        seq.last_token_time = now

    def pooled(self, request: Request, now: float) -> None:
        """A pooling request's one result: what the first token is to a generation."""
        request.first_token_time = now
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.stats.time_to_first_token.append(now - request.arrival_time)

    def unloaded_adapter(self, name: str) -> None:
        """A LoRA adapter was forgotten, no request running under it any more."""
        self.stats.unloaded_loras.append(name)

    def finished(self, request: Request, now: float, finish_reason: str | None = None) -> None:
        """The request ended; `finish_reason` when the caller decides it (the engine failed
        it), else the request's own (a beam search's: its best hypothesis')."""
        first_token, scheduled = request.first_token_time, request.first_scheduled_time
        generated = sum(seq.num_output_tokens for seq in request.sequences)
        if request.beam is not None:
            generated = request.beam.num_generated_tokens
            best = request.beam.finished[:1]
            aborted = request.beam.aborted or not best
            own_reason = "abort" if aborted else best[0].finish_reason
        else:
            own_reason = request.sequences[0].finish_reason or "abort"
        self.stats.finished.append(
            FinishedRequest(
                finish_reason=finish_reason or own_reason,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_generation_tokens=generated,
                e2e_latency=now - request.arrival_time,
                queue_time=None if scheduled is None else scheduled - request.arrival_time,
                prefill_time=None
                if first_token is None or scheduled is None
                else first_token - scheduled,
                decode_time=None if first_token is None else now - first_token,
                kv_wait_time=request.sequences[0].kv_wait_until(now),
                lora_name=lora.lora_name if (lora := request.sequences[0].lora) else None,
            )
        )


def _adapter_names(seqs: Iterable[Sequence]) -> list[str]:
    return sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None})
