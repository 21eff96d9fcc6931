"""Recording, on the engine thread, what the metrics are made of: each step's tokens, each
request's first scheduling, its tokens and its end, into the `EngineStats` that `take` hands
over and starts afresh."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.sequence import Sequence
from engine.processing.request import Request
from engine.stats import EngineStats, FinishedRequest


class StatsRecorder:
    def __init__(self) -> None:
        self.stats = EngineStats()

    def take(self) -> EngineStats:
        """What was recorded since the previous call."""
        stats, self.stats = self.stats, EngineStats()
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
