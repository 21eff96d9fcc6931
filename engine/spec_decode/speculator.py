"""Speculative decoding in the step: drafts proposed after a step's outputs, scheduled with
the sequence's next token, and verified on that step's logits.

Verification samples the target at each drafted position in turn with the ordinary sampler, the
sequence having taken the tokens accepted before it (so penalties, min_tokens, grammars, stop
tokens and max_tokens see exactly the state they would without drafts), and accepts the draft
when the sample equals it; the first sample that differs is the step's last token. Every token
is thus drawn from the target's distribution given the tokens before it: greedy requests get
the tokens they get without speculation, and a seeded request draws the same random numbers.
For a draft that puts all its mass on one token (prompt lookup, a draft model's argmax) this is
rejection sampling: the draft is accepted with probability p(draft), and a rejection emits a
token from p without the draft, renormalized.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from config import SpeculativeConfig
from engine.core.request_failures import RequestFailures
from engine.core.scheduler_output import Sample, ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence
from engine.spec_decode.proposer import Proposer, StepObserver
from engine.stats import SpecDecodeStats
from engine.worker.sampler import Sampler

Take = Callable[[Sequence, Sample], None]


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
        observer: StepObserver | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.observer = observer
        self.stats = SpecDecodeStats()

    def observe(self, out: SchedulerOutput) -> None:
        """The target just ran `out`'s step: the method reads what it needs of it."""
        if self.observer is not None:
            self.observer.observe(out)

    def take_stats(self) -> SpecDecodeStats:
        stats, self.stats = self.stats, SpecDecodeStats()
        return stats

    def close(self) -> None:
        self.proposer.close()

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for the running sequences whose next step decodes one token; none in a step
        with more running sequences than the config's batch size (verifying several rows each
        then costs more than the tokens it saves)."""
        if len(running) > self.config.max_batch_size:
            return
        seqs, limits = [], []
        for seq in running:
            room = self._room(seq)
            if room > 0 and seq.beam is None and seq.num_tokens - seq.num_computed_tokens == 1:
                seqs.append(seq)
                limits.append(room)
        if not seqs:
            return
        for seq, limit, drafts in zip(seqs, limits, self.proposer.propose(seqs, limits)):
            seq.spec_token_ids = list(drafts[:limit])

    def _room(self, seq: Sequence) -> int:
        """Drafts the sequence can take: never a token past max_tokens or the context limit
        (the step samples one token beyond its drafts)."""
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room

    def verify(
        self,
        out: SchedulerOutput,
        logits_rows: list[tuple[int, int]],
        logits: torch.Tensor,
        taken: dict[int, list[Sample]],
        sampler: Sampler,
        take: Take,
        failures: RequestFailures,
    ) -> None:
        """Sample the drafted positions after each sequence's first sample (already taken, in
        `taken[id(seq)]`), position by position over all sequences, while every draft so far
        was accepted; each token is taken as it is sampled and recorded in `taken`. Rejected
        rows' K/V is left to be overwritten: the sequence's computed tokens end at its last
        token."""
        drafted = [
            (s, first) for s, (first, _) in zip(out.scheduled, logits_rows) if s.draft_token_ids
        ]
        for s, _ in drafted:
            if not failures.failed(s.seq.request_id):
                s.seq.num_computed_tokens -= len(s.draft_token_ids)
        position = 0
        while drafted:
            alive = [(s, first) for s, first in drafted if self._accepted(s, position, taken)]
            position += 1
            drafted = [(s, first) for s, first in alive if position < len(s.draft_token_ids)]
            if not alive:
                break
            seqs = [s.seq for s, _ in alive]
            rows = torch.stack([logits[first + position] for _, first in alive])
            samples = sampler.sample_or_fail(rows, seqs, partial(_fail, failures, seqs))
            for seq, sample in zip(seqs, samples):
                if sample is None:
                    continue
                seq.num_computed_tokens += 1  # the accepted draft's row is the sequence's own
                taken[id(seq)].append(sample)
                failures.run(seq.request_id, partial(take, seq, sample))
        for s in out.scheduled:
            if s.draft_token_ids:
                self.stats.add(len(s.draft_token_ids), _num_accepted(s, taken.get(id(s.seq), [])))

    @staticmethod
    def _accepted(s: ScheduledSequence, position: int, taken: dict[int, list[Sample]]) -> bool:
        """The sequence took the draft at `position` and goes on: the next row is its own."""
        samples = taken.get(id(s.seq), [])
        return (
            len(samples) == position + 1
            and samples[position].token_id == s.draft_token_ids[position]
            and not s.seq.is_finished
        )


def _num_accepted(s: ScheduledSequence, samples: list[Sample]) -> int:
    """How many of the drafts, from the first, the sequence's samples agreed with."""
    accepted = 0
    for sample, draft in zip(samples, s.draft_token_ids):
        if sample.token_id != draft:
            break
        accepted += 1
    return accepted


def _fail(failures: RequestFailures, seqs: list[Sequence], i: int, exc: Exception) -> None:
    failures.add(seqs[i].request_id, exc)
