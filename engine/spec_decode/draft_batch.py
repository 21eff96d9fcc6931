"""The draft model's batches: runs of tokens per sequence, written into the target's KV slots.

The draft keeps its K/V in blocks of the same ids as the target's, so a run's slots and block
table are the target's own (`KVCacheManager.block_table`); only the tensors they index differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.model_input import HostBatch


@dataclass(frozen=True)
class DraftRun:
    """Tokens of one sequence at positions `start`, `start + 1`, ..., attending to every
    position before them; `wants_logits`: its last row's logits are read."""

    table: list[int]
    start: int
    token_ids: list[int]
    wants_logits: bool

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def build_draft_batch(runs: list[DraftRun], block_size: int) -> HostBatch:
    """One varlen batch of the runs (at most one per sequence: a run attends only to K/V
    stored by earlier batches and by itself)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    for run in runs:
        input_ids.extend(run.token_ids)
        span = range(run.start, run.end)
        positions.extend(span)
        slots.extend(run.table[p // block_size] * block_size + p % block_size for p in span)
        if run.wants_logits:
            logits_indices.append(len(input_ids) - 1)
    width = max(len(run.table) for run in runs)
    flat = [b for run in runs for b in run.table + [0] * (width - len(run.table))]
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        query_lens=[len(run.token_ids) for run in runs],
        context_lens=[run.end for run in runs],
        block_tables=torch.tensor(flat, dtype=torch.int32).view(len(runs), width),
        logits_indices=logits_indices,
        block_copies=[],
    )
