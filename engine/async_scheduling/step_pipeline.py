"""Steps overlapped with the model: while the model thread runs step N, the engine thread
schedules step N+1 and builds its batch, then, once N's logits are in, samples them, starts N+1,
and makes N's outputs (detokenizing, stop strings, streaming) while N+1 runs.

Step N+1 is scheduled before N's tokens are known: each sequence is planned past the tokens
still in flight (`Sequence.num_inflight_tokens`, `num_pending_tokens`), and an input row whose
token N is sampling is filled just before N+1 starts. A sequence that N ends (a stop token, its
length, a grammar's end) or that its outputs end (a stop string), or that is aborted, failed or
preempted meanwhile, has its row in N+1 computed and discarded: its token never reaches it, its
sampler never draws for it, its blocks are back in the pool before any step can reuse them
(steps run one after another on the model thread, so a block freed while N+1 runs is written
by a later step only after N+1 has).

Only sampled ids cross from N to N+1 on the host; on a GPU a step's logits are read back before
the next starts, so the overlap there is the host's work against the model's.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.request_failures import RequestFailures
from engine.core.scheduler_output import Sample, SchedulerOutput
from engine.daemon_pool import DaemonThreadPool
from engine.outputs import EngineOutput
from engine.worker.model_input import HostBatch, StepBatch


@dataclass
class PlannedStep:
    """A scheduled step and its batch, with each sequence's preemption count when it was
    scheduled (a different count later means it was preempted since: its row is discarded)."""

    out: SchedulerOutput
    batch: StepBatch
    preemptions: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.preemptions = [s.seq.num_preemptions for s in self.out.scheduled]

    def live(self) -> tuple[SchedulerOutput, list[tuple[int, int]]]:
        """The step as far as its results still apply: the scheduled sequences that are still
        running as they were when it was scheduled, and their logits rows."""
        out, rows = self.out, self.batch.logits_rows
        keep = [
            not s.seq.is_finished and s.seq.num_preemptions == n
            for s, n in zip(out.scheduled, self.preemptions, strict=True)
        ]
        if all(keep):
            return out, rows
        return (
            SchedulerOutput(
                [s for s, k in zip(out.scheduled, keep) if k],
                out.block_copies,
                out.preempted,
                out.has_beam_rows,
            ),
            [r for r, k in zip(rows, keep) if k],
        )


@dataclass
class AppliedStep:
    """A step whose tokens the scheduler has taken, its outputs still to make."""

    out: SchedulerOutput
    logits_rows: list[tuple[int, int]]
    logits: torch.Tensor
    samples: list[list[Sample]]  # per sampler, the tokens it took (none: it failed)
    failures: RequestFailures


class PipelinedEngine(Protocol):
    """What the pipeline drives: LLMEngine's step, in its parts."""

    def plan_step(self) -> PlannedStep | list[EngineOutput]: ...

    def apply_step(self, step: PlannedStep, logits: torch.Tensor) -> AppliedStep: ...

    def emit_step(self, step: AppliedStep) -> list[EngineOutput]: ...

    def sync_step(self) -> list[EngineOutput]: ...


class StepPipeline:
    """Runs `execute` on a model thread of its own, one step at a time, one step ahead."""

    def __init__(
        self,
        engine: PipelinedEngine,
        execute: Callable[[HostBatch], torch.Tensor],
        needs_sync: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self.execute = execute
        # Whether the next step must run alone (a beam search's rows: its group forks and
        # prunes beams between steps).
        self.needs_sync = needs_sync
        # A daemon thread: a step stuck in the model must not hold up the process's exit.
        self._model = DaemonThreadPool(1, "pagedserve-model")
        # An engine dropped without close() (an `LLM` that goes out of scope) ends its thread too;
        # the callback holds the thread pool, not this pipeline, so it does not keep it alive.
        weakref.finalize(self, self._model.shutdown, False)
        self._running: tuple[PlannedStep, concurrent.futures.Future[torch.Tensor]] | None = None

    def step(self) -> list[EngineOutput]:
        """The outputs of the step before the one this starts."""
        if self.needs_sync():
            return self.drain() + self.engine.sync_step()
        upcoming = self.engine.plan_step()
        outputs = [] if isinstance(upcoming, PlannedStep) else upcoming
        applied = self._apply_running()
        if isinstance(upcoming, PlannedStep):
            upcoming.batch.fill_pending_tokens()
            self._running = (upcoming, self._model.submit(self.execute, upcoming.batch.host))
        if applied is None:
            return outputs
        return self.engine.emit_step(applied) + outputs

    def drain(self) -> list[EngineOutput]:
        """Finish the step still running, if any: its outputs."""
        applied = self._apply_running()
        return [] if applied is None else self.engine.emit_step(applied)

    def _apply_running(self) -> AppliedStep | None:
        if self._running is None:
            return None
        step, logits = self._running
        self._running = None
        return self.engine.apply_step(step, logits.result())

    def close(self) -> None:
        """Stop the model thread once its step, if any, is done (not waiting on a stuck one)."""
        self._model.shutdown()
