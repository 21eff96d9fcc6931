"""Pooling requests (embeddings) in the engine's step: one sequence each, scheduled whole in one
step (never chunked), finished by that step, its blocks back in the pool after it.

(Beside `engine/pooling/`, not in it: the core's sequences read that folder's parameters, and
this reads the core.)"""

from __future__ import annotations

import time

import torch

from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.outputs import EmbeddingOutput, PoolingRequestOutput
from engine.pooling import PoolerSpec, PoolingParams
from engine.processing.request import Request
from engine.sampling_params import SamplingParams
from engine.stats_recorder import StatsRecorder

# What a pooling sequence carries where a generating one has its sampling: it samples nothing.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


class PoolingRequests:
    """The pooling requests among the engine's requests: `requests` is the engine's table,
    which a request leaves with its embedding; `pooler`: None on a generating model."""

    def __init__(
        self,
        requests: dict[str, Request],
        scheduler: Scheduler,
        recorder: StatsRecorder,
        pooler: PoolerSpec | None,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.recorder = recorder
        self.pooler = pooler

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: PoolingParams,
        arrival: float,
    ) -> None:
        """Queue a checked input to embed."""
        seq = Sequence(
            seq_id=request_id,
            request_id=request_id,
            index=0,
            prompt_token_ids=prompt_ids,
            params=_POOLING_SAMPLING,
            arrival_time=arrival,
            pooling=params,
        )
        self.requests[request_id] = Request(
            request_id, prompt, prompt_ids, [seq], arrival_time=arrival
        )
        self.scheduler.add(seq)

    def finish(self, out: SchedulerOutput, embeddings: torch.Tensor) -> list[PoolingRequestOutput]:
        """Every scheduled sequence ran whole: its embedding is done, and it finishes now, its
        blocks back in the pool before the next step."""
        now = time.time()
        outputs = []
        for s, embedding in zip(out.scheduled, embeddings, strict=True):
            seq = s.seq
            assert seq.pooling is not None and s.num_new_tokens == seq.num_tokens
            seq.num_computed_tokens += s.num_new_tokens
            seq.num_inflight_tokens -= s.num_new_tokens
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
            request = self.requests.pop(seq.request_id)
            self.recorder.pooled(request, now)
            self.recorder.finished(request, now)
            dims = seq.pooling.dimensions
            if dims is not None:  # a Matryoshka prefix, itself normalized as the whole was
                embedding = embedding[:dims]
                if self.pooler is not None and self.pooler.normalize:
                    embedding = torch.nn.functional.normalize(embedding, dim=0)
            outputs.append(
                PoolingRequestOutput(
                    request.request_id, request.prompt_token_ids, EmbeddingOutput(embedding)
                )
            )
        return outputs
