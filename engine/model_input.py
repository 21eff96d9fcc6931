"""Flatten one scheduled step into the varlen batch the model runs on.

`HostBatch` is the step on the host, in plain integers; it packs into one int64 tensor (the
form it travels in to other tensor-parallel ranks) and moves to the device as `ModelInput`.
"""

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
    block_copies: list[tuple[int, int]]


@dataclass
class HostBatch:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 on the host, padded with 0
    logits_indices: list[int]
    block_copies: list[tuple[int, int]]

    def pack(self) -> torch.Tensor:
        """Everything in one int64 tensor: a header of lengths, then each field in order."""
        reqs, width = self.block_tables.shape
        header = [len(self.input_ids), reqs, width, len(self.logits_indices), len(self.block_copies)]
        copies = [i for pair in self.block_copies for i in pair]
        body = [*header, *self.input_ids, *self.positions, *self.slots, *self.query_lens, *self.context_lens,
                *self.logits_indices, *copies]
        return torch.cat([torch.tensor(body, dtype=torch.int64), self.block_tables.flatten().long()])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> HostBatch:
        values = packed.tolist()
        tokens, reqs, width, logits, copies = values[:5]
        at = 5

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n : at]

        input_ids, positions, slots = take(tokens), take(tokens), take(tokens)
        query_lens, context_lens = take(reqs), take(reqs)
        logits_indices, pairs = take(logits), take(2 * copies)
        tables = packed[at : at + reqs * width].view(reqs, width).to(torch.int32)
        return cls(input_ids, positions, slots, query_lens, context_lens, tables, logits_indices,
                   list(zip(pairs[::2], pairs[1::2])))

    def to_device(self, device: torch.device) -> ModelInput:
        cu = [0]
        for n in self.query_lens:
            cu.append(cu[-1] + n)

        def dev(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        attn = AttentionMetadata(
            slot_mapping=dev(self.slots),
            block_tables=self.block_tables.to(device, non_blocking=True),
            cu_seqlens_q=dev(cu, torch.int32),
            seqlens_k=dev(self.context_lens, torch.int32),
            query_lens=self.query_lens,
            context_lens=self.context_lens,
        )
        return ModelInput(dev(self.input_ids), dev(self.positions), attn, dev(self.logits_indices), self.block_copies)


@dataclass
class StepBatch:
    host: HostBatch
    # Per scheduled request, its rows in the logits: (first, count); count 0 when none.
    logits_rows: list[tuple[int, int]]


def build_step_batch(out: SchedulerOutput, block_size: int) -> StepBatch:
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
    host = HostBatch(input_ids, positions, slots, query_lens, context_lens, tables, logits_indices, out.block_copies)
    return StepBatch(host, logits_rows)
