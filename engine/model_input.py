"""Flatten one scheduled step into the varlen batch the model runs on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import SchedulerOutput
from kernels.attention import AttentionMetadata


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are needed, in request order
    # Per scheduled request, its rows in the logits: (first, count); count 0 when none.
    logits_rows: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]


def build_model_input(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    logits_rows: list[tuple[int, int]] = []
    for s in out.scheduled:
        req = s.request
        start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
        row0 = len(input_ids)
        input_ids.extend(req.all_token_ids[start:end])
        positions.extend(range(start, end))
        table = s.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(end - start)
        context_lens.append(end)
        first = len(logits_indices)
        if req.wants_prompt_logprobs:
            # Every row of the chunk: row p predicts token p + 1 of the prompt.
            logits_indices.extend(range(row0, row0 + end - start))
        elif s.samples:
            logits_indices.append(row0 + end - start - 1)
        logits_rows.append((first, len(logits_indices) - first))

    max_blocks = max((len(s.block_table) for s in out.scheduled), default=0)
    tables = torch.zeros((len(out.scheduled), max(max_blocks, 1)), dtype=torch.int32)
    for i, s in enumerate(out.scheduled):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)

    def dev(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    attn = AttentionMetadata(
        slot_mapping=dev(slots),
        block_tables=tables.to(device, non_blocking=True),
        cu_seqlens_q=dev(cu, torch.int32),
        seqlens_k=dev(context_lens, torch.int32),
        query_lens=query_lens,
        context_lens=context_lens,
    )
    return ModelInput(
        input_ids=dev(input_ids),
        positions=dev(positions),
        attn=attn,
        logits_indices=dev(logits_indices),
        logits_rows=logits_rows,
        block_copies=out.block_copies,
    )
