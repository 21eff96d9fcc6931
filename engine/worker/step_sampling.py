"""What a step reads from its logits rows: each sampler's token and the prompt logprobs asked
for, every failure charged to its own request (the others go on)."""

from __future__ import annotations

import logging
from functools import partial

import torch

from engine.core.request_failures import RequestFailures
from engine.core.scheduler_output import Sample, SchedulerOutput
from engine.core.sequence import Sequence
from engine.worker.sampler import Sampler, position_logprobs

log = logging.getLogger(__name__)


def sample_step(
    sampler: Sampler,
    out: SchedulerOutput,
    logits_rows: list[tuple[int, int]],
    logits: torch.Tensor,
    failures: RequestFailures,
) -> list[Sample | None]:
    """Each sampler's token from its sequence's last row (siblings share their parent's);
    None for a sampler whose request failed."""
    # The row after the sequence's own tokens (drafts' rows, if any, come after it).
    rows = [
        logits[first + count - 1 - len(s.draft_token_ids)]
        for s, (first, count) in zip(out.scheduled, logits_rows)
        for _ in s.samplers
    ]
    if not rows:
        return []
    seqs = out.samplers
    try:
        return sampler.sample_or_fail(
            torch.stack(rows), seqs, lambda i, exc: failures.add(seqs[i].request_id, exc)
        )
    except Exception:  # noqa: BLE001 - work shared by the rows raised: each alone says whose
        # (before any row drew a random number: sampled again, each row draws as it would)
        log.warning("sampling the step's rows together failed; sampling each row alone")
        return [
            failures.run(seq.request_id, partial(_sample_one, sampler, row, seq))
            for row, seq in zip(rows, seqs)
        ]


def _sample_one(sampler: Sampler, row: torch.Tensor, seq: Sequence) -> Sample:
    return sampler(row.unsqueeze(0).clone(), [seq])[0]


def record_prompt_logprobs(
    out: SchedulerOutput,
    logits_rows: list[tuple[int, int]],
    logits: torch.Tensor,
    failures: RequestFailures,
) -> None:
    """The logprobs of the prompt tokens this step's chunks predict, for the sequences that
    asked for them."""
    for s, (first, count) in zip(out.scheduled, logits_rows):
        if s.seq.wants_prompt_logprobs:
            failures.run(
                s.seq.request_id,
                partial(_add_prompt_logprobs, s.seq, logits[first : first + count]),
            )


def _add_prompt_logprobs(seq: Sequence, rows: torch.Tensor) -> None:
    """Row j of a chunk sits at position p = num_computed + j and predicts prompt token p + 1."""
    assert seq.prompt_logprobs is not None
    logprobs = torch.log_softmax(rows, dim=-1)
    top_n = seq.params.prompt_logprobs or 0
    for j in range(rows.shape[0]):
        target = seq.num_computed_tokens + j + 1
        if target == len(seq.prompt_logprobs) and target < seq.num_prompt_tokens:
            token = seq.prompt_token_ids[target]
            seq.prompt_logprobs.append(position_logprobs(logprobs[j], token, top_n))
