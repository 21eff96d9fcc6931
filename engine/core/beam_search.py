"""Beam search over forked sequences: one `BeamGroup` per beam-search request.

The group's live beams are ordinary running sequences that decode one token per step over
shared, ref-counted KV blocks. A beam does not sample: its last logits row is handed to the
group, and once every live beam has handed in its row the group takes one beam step, as
transformers' `generate(num_beams=k)` does:

- the 2k best (beam, token) continuations by cumulative logprob (log-softmax of the raw logits
  in float32) are ranked; those that end (a stop token, or the length limit) among the first k
  become finished hypotheses scored by sum_logprobs / generated_len ** length_penalty (the k
  best kept), the first k that do not end are the next beams;
- a beam chosen more than once forks (its copies share all its blocks; the first write into the
  shared partial block copies it), a beam chosen none is pruned and its blocks freed at once;
- the search ends as `early_stopping` says: True when k hypotheses are finished, False and
  "never" when no running beam can beat the worst of them (by transformers' heuristic).

A beam whose row is in but whose siblings' are not (the token budget ran out, or a sibling was
preempted and is recomputing) is skipped by the scheduler until the group steps.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus

_FLOAT32_SMALLEST = 2.0**-149  # the smallest positive float32 (a subnormal)


@dataclass
class BeamHypothesis:
    """A finished beam: its generated tokens, their summed logprob and its ranking score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id, when it was not EOS


@dataclass
class BeamGroup:
    root: Sequence
    width: int
    length_penalty: float
    early_stopping: bool | str
    stop_ids: frozenset[int]  # EOS (unless ignored) and the stop token ids
    max_new_tokens: int  # max_tokens, or what max_model_len leaves after the prompt
    beams: list[Sequence] = field(default_factory=list)  # best first
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # float32, per beam
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # seq_id -> its last logits row
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most width
    num_generated: int = 0
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"
    done: bool = False
    aborted: bool = False
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.beams = [self.root]
        self.scores = torch.zeros(1, dtype=torch.float32)
        self.root.beam = self

    # ------------------------------------------------------------- rows in

    def take_row(self, seq: Sequence, logits_row: torch.Tensor) -> bool:
        """Keep a beam's last logits row; true when every live beam's row is in."""
        # A copy: the row is a view of the whole step's logits, which a beam waiting for its
        # siblings would otherwise keep alive.
        self.rows[seq.seq_id] = logits_row.clone()
        return len(self.rows) == len(self.beams)

    def seats_to_come(self) -> int:
        return self.width - len(self.beams)

    def drop_row(self, seq: Sequence) -> None:
        """A preempted beam recomputes its row: the one it had handed in is stale."""
        self.rows.pop(seq.seq_id, None)

    # ------------------------------------------------------------- one beam step

    def advance(self, scheduler: Scheduler) -> None:
        """Rank every continuation, move the beams on (forking and pruning), finish hypotheses."""
        rows = torch.stack([self.rows[b.seq_id] for b in self.beams]).float()
        self.rows.clear()
        vocab = rows.shape[1]
        # transformers keeps (number of stop tokens + 1) * k candidates, at least 2k, so that at
        # least k of them go on even if stop tokens rank first.
        keep = min(max(2, 1 + len(self.stop_ids)) * self.width, rows.numel())
        logprobs = torch.log_softmax(rows, dim=-1) + self.scores.to(rows.device)[:, None]
        top_values, top_indices = logprobs.flatten().topk(keep)
        values, flat = top_values.cpu(), top_indices.tolist()

        self.num_generated += 1
        length = self.num_generated
        at_limit = length >= self.max_new_tokens
        candidates = [(i // vocab, i % vocab) for i in flat]
        ends = [at_limit or token in self.stop_ids for _, token in candidates]

        self._finish_hypotheses(candidates, ends, values, length)
        going_on = [r for r in range(keep) if not ends[r]][: self.width]
        if not going_on:  # every continuation ends: the length limit
            self._end(scheduler)
            return
        self.scores = values[going_on]
        self._move_beams(scheduler, [candidates[r] for r in going_on])
        self._update_improvable()
        full = len(self.finished) == self.width
        if not self.improvable or (full and self.early_stopping is True):
            self._end(scheduler)

    def _finish_hypotheses(
        self,
        candidates: list[tuple[int, int]],
        ends: list[bool],
        values: torch.Tensor,
        length: int,
    ) -> None:
        """Among the first k candidates, those that end become hypotheses (the k best kept) —
        unless the search could no longer improve, or early_stopping=True and k are in."""
        if not self.improvable or (
            len(self.finished) == self.width and self.early_stopping is True
        ):
            return
        scores = values / length_divisor(length, self.length_penalty)  # as transformers divides
        added = False
        for r in range(min(self.width, len(candidates))):
            if not ends[r]:
                continue
            beam_index, token = candidates[r]
            parent = self.beams[beam_index]
            stopped = token in self.stop_ids
            self.finished.append(
                BeamHypothesis(
                    token_ids=[*parent.output_token_ids, token],
                    cumulative_logprob=float(values[r]),
                    score=float(scores[r]),
                    finish_reason="stop" if stopped else "length",
                    stop_reason=token
                    if stopped and token in parent.params.stop_token_ids
                    else None,
                )
            )
            added = True
        if added:
            self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier first on ties
            del self.finished[self.width :]

    def _update_improvable(self) -> None:
        """transformers' heuristic: can the best running beam still beat the worst finished one?
        Its best case is its score at the current length, or (early_stopping="never" with a
        length penalty that favours length) at the longest length allowed."""
        if not self.improvable:
            return
        if len(self.finished) < self.width:
            return  # a free slot: anything running can still enter
        longest = self.early_stopping == "never" and self.length_penalty > 0.0
        length = self.max_new_tokens if longest else self.num_generated
        best_running = self.scores[0] / length_divisor(length, self.length_penalty)
        worst_finished = torch.tensor(min(h.score for h in self.finished), dtype=torch.float32)
        self.improvable = bool(best_running > worst_finished)

    def _move_beams(self, scheduler: Scheduler, chosen: list[tuple[int, int]]) -> None:
        """The next beams: each chosen (beam, token). A beam chosen again is forked before any
        token is appended (a fork shares its blocks as they are), one chosen none is pruned."""
        taken: set[int] = set()
        next_beams: list[Sequence] = []
        for beam_index, _ in chosen:
            parent = self.beams[beam_index]
            if beam_index in taken:
                next_beams.append(self._fork(scheduler, parent))
            else:
                taken.add(beam_index)
                next_beams.append(parent)
        for beam_index, beam in enumerate(self.beams):
            if beam_index not in taken:
                scheduler.finish(beam)  # pruned: its blocks go back now
        for beam, (_, token) in zip(next_beams, chosen):
            beam.append_token(token)
        self.beams = next_beams

    def _fork(self, scheduler: Scheduler, parent: Sequence) -> Sequence:
        child = Sequence(
            seq_id=f"{parent.request_id}~{next(self._ids)}",
            request_id=parent.request_id,
            index=0,
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            eos_token_id=parent.eos_token_id,
            status=SequenceStatus.RUNNING,
            output_token_ids=list(parent.output_token_ids),
            lora=parent.lora,
        )
        child.beam = self
        child.num_computed_tokens = parent.num_computed_tokens
        scheduler.kv.fork(parent, child, num_shared_tokens=parent.num_tokens)
        scheduler.running.append(child)
        return child

    def _end(self, scheduler: Scheduler) -> None:
        """The search is over: every live beam leaves the scheduler and frees its blocks."""
        for beam in self.beams:
            if not beam.is_finished:
                scheduler.finish(beam)
        self.rows.clear()
        self.done = True

    def abort(self, scheduler: Scheduler, reason: str = "abort") -> None:
        """Stop the search early: aborted, or "error" when the engine failed it."""
        self.aborted = True
        for beam in self.beams:
            if not beam.is_finished:
                beam.finish_reason = reason
        self._end(scheduler)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(h.token_ids) for h in self.finished)


def length_divisor(length: int, length_penalty: float) -> float:
    """length ** length_penalty, what a hypothesis' summed logprob is divided by to rank it:
    computed in float64 as transformers does, then kept within what the float32 division can
    take. Past float64's range it is inf (every such score a tie at 0) instead of an
    OverflowError; below float32's smallest step it is that step, never 0 (0 / 0 is NaN, which
    would make the ranking meaningless)."""
    try:
        divisor = float(length) ** length_penalty
    except OverflowError:
        return math.inf
    return max(divisor, _FLOAT32_SMALLEST)


def beam_group_for(root: Sequence, vocab_size: int, max_model_len: int) -> BeamGroup:
    """The group a beam-search request's first sequence starts."""
    params = root.params
    stop_ids = set(params.stop_token_ids)
    if root.eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(root.eos_token_id)
    room = max_model_len - root.num_prompt_tokens
    limit = room if params.max_tokens is None else min(params.max_tokens, room)
    return BeamGroup(
        root=root,
        width=params.n,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        stop_ids=frozenset(i for i in stop_ids if 0 <= i < vocab_size),
        max_new_tokens=max(1, limit),
    )
