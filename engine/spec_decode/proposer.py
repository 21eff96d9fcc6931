"""What a speculative method provides: draft tokens for sequences about to decode."""

from __future__ import annotations

from typing import Protocol

from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        """Up to `max_drafts[i]` guesses of the tokens that follow `seqs[i]`'s tokens (its
        last token is sampled, not yet computed). Fewer, or none, when it has no good guess.
        Called on the engine thread after each step's outputs, for the running sequences
        that decode next; a sequence it does not see again has finished or was preempted."""
        ...

    def close(self) -> None:
        """Release what the method holds (a draft model's executor)."""
        ...


class StepObserver(Protocol):
    def observe(self, out: SchedulerOutput) -> None:
        """Called right after the target ran the step `out` scheduled, before its samples are
        taken: a method that reads what the target computed (EAGLE-3's hidden states)."""
        ...
