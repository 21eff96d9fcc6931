"""Flatten one scheduled step into the varlen batch the model runs on.

`HostBatch` is the step on the host, in plain integers; it packs into one int64 tensor (the
form it travels in to other tensor-parallel ranks) and moves to the device as `ModelInput`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.multimodal.step_input import Chunk, MultiModalBatch, multimodal_batch
from kernels.attention import AttentionMetadata

HEADER = 6  # the packed form's lengths: tokens, requests, table width, logits, copies, LoRA slots


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are needed, in scheduled order
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
    # Per request, the LoRA slot its rows run under (-1: the base model); empty without LoRA.
    lora_slots: list[int] = field(default_factory=list)
    # The step's image rows and encoder work; None without images. Not packed: it stays on
    # rank 0 (vision-language models run on one device).
    mm: MultiModalBatch | None = None
    # The packed form, kept once made: rank 0 packs a step for the pipe and for its own upload,
    # a worker receives it packed. A batch is never changed after it is packed.
    _packed: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def pack(self) -> torch.Tensor:
        """Everything in one int64 tensor: a header of lengths, then each field in order."""
        if self._packed is None:
            self._packed = self._pack()
        return self._packed

    def _pack(self) -> torch.Tensor:
        reqs, width = self.block_tables.shape
        header = [
            len(self.input_ids),
            reqs,
            width,
            len(self.logits_indices),
            len(self.block_copies),
            len(self.lora_slots),
        ]
        copies = [i for pair in self.block_copies for i in pair]
        body = [
            *header,
            *self.input_ids,
            *self.positions,
            *self.slots,
            *self.query_lens,
            *self.context_lens,
            *self.logits_indices,
            *copies,
            *self.lora_slots,
        ]
        return torch.cat(
            [torch.tensor(body, dtype=torch.int64), self.block_tables.flatten().long()]
        )

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> HostBatch:
        values = packed.tolist()
        tokens, reqs, width, logits, copies, loras = values[:HEADER]
        at = HEADER

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return values[at - n : at]

        input_ids, positions, slots = take(tokens), take(tokens), take(tokens)
        query_lens, context_lens = take(reqs), take(reqs)
        logits_indices, pairs, lora_slots = take(logits), take(2 * copies), take(loras)
        tables = packed[at : at + reqs * width].view(reqs, width).to(torch.int32)
        return cls(
            input_ids,
            positions,
            slots,
            query_lens,
            context_lens,
            tables,
            logits_indices,
            list(zip(pairs[::2], pairs[1::2])),
            lora_slots,
            _packed=packed,
        )

    def to_device(self, device: torch.device, upload: PinnedUpload | None = None) -> ModelInput:
        """The batch on `device`: packed, copied in one transfer, then viewed field by field."""
        packed = self.pack()
        dev = upload(packed) if upload is not None else packed.to(device)
        tokens, reqs = len(self.input_ids), len(self.query_lens)
        at = HEADER

        def take(n: int) -> torch.Tensor:
            nonlocal at
            at += n
            return dev[at - n : at]

        input_ids, positions, slots = take(tokens), take(tokens), take(tokens)
        query_lens, context_lens = take(reqs), take(reqs).to(torch.int32)
        logits_indices = take(len(self.logits_indices))
        take(2 * len(self.block_copies))  # copied by the runner from the host list
        take(len(self.lora_slots))  # read by the runner from the host list
        tables = dev[at:].view(reqs, self.block_tables.shape[1]).to(torch.int32)
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            cu_seqlens_q=F.pad(torch.cumsum(query_lens, 0, dtype=torch.int32), (1, 0)),
            seqlens_k=context_lens,
            query_lens=self.query_lens,
            context_lens=self.context_lens,
        )
        return ModelInput(input_ids, positions, attn, logits_indices, self.block_copies)


def _multimodal(out: SchedulerOutput) -> MultiModalBatch | None:
    chunks = [
        Chunk(s.seq.mm, s.start, s.start + s.num_new_tokens, s.seq.num_prompt_tokens)
        for s in out.scheduled
    ]
    return multimodal_batch(chunks, out.encoder_inputs, out.encoder_evicted)


class PinnedUpload:
    """Host int64 tensors to a CUDA device through one reused page-locked buffer, so that the
    copy is asynchronous (a copy from pageable memory makes the host wait). Elsewhere a plain
    `.to(device)`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return packed.to(self.device)
        n = packed.numel()
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the buffer: refill it
        if self.buffer is None or self.buffer.numel() < n:
            self.buffer = torch.empty(
                max(n, 2 * (0 if self.buffer is None else self.buffer.numel())),
                dtype=torch.int64,
                pin_memory=True,
            )
        self.buffer[:n].copy_(packed)
        out = self.buffer[:n].to(self.device, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return out


@dataclass
class StepBatch:
    host: HostBatch
    # Per scheduled sequence, its rows in the logits: (first, count); count 0 when none.
    logits_rows: list[tuple[int, int]]
    # Input rows whose token the step before is still sampling (async scheduling): (row,
    # sequence, position), filled by `fill_pending_tokens` once that step's results are in.
    pending: list[tuple[int, Sequence, int]] = field(default_factory=list)

    def fill_pending_tokens(self) -> None:
        """Each pending row takes its sequence's token, sampled since; a sequence that took
        none (it failed or was preempted) has its row discarded, so any id will do."""
        assert self.host._packed is None, "filled after it was packed"
        ids = self.host.input_ids
        for row, seq, position in self.pending:
            ids[row] = seq.all_token_ids[position] if position < seq.num_tokens else 0
        self.pending = []


def build_step_batch(
    out: SchedulerOutput,
    block_size: int,
    lora_slot: Callable[[Sequence], int] | None = None,
    multimodal: bool = False,
) -> StepBatch:
    """`lora_slot`: each sequence's adapter slot (-1 for the base model), when LoRA is on;
    `multimodal`: the model reads images, whose rows the batch then lists."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    logits_rows: list[tuple[int, int]] = []
    pending: list[tuple[int, Sequence, int]] = []
    for s in out.scheduled:
        seq = s.seq
        start, end = s.start, s.start + s.num_new_tokens
        real_end = start + s.num_real_tokens
        row0 = len(input_ids)
        known = seq.all_token_ids[start:real_end]
        input_ids.extend(known)
        for position in range(start + len(known), real_end):  # tokens not sampled yet
            pending.append((len(input_ids), seq, position))
            input_ids.append(0)
        input_ids.extend(s.draft_token_ids)
        positions.extend(range(start, end))
        table = s.block_table
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        query_lens.append(end - start)
        context_lens.append(end)
        first = len(logits_indices)
        if seq.wants_prompt_logprobs or s.draft_token_ids:
            # Every row of the chunk: row p predicts token p + 1 of the prompt, or verifies
            # the draft at p + 1.
            logits_indices.extend(range(row0, row0 + end - start))
        elif s.samples_token or s.beam_row:
            logits_indices.append(row0 + end - start - 1)
        logits_rows.append((first, len(logits_indices) - first))

    # One tensor made from one flat list: three small tensor ops per request cost ~30 us each
    # step, 8 ms at 256 requests. A slid-past entry (-1) is read by no backend; block 0 keeps
    # every entry an index.
    width = max((len(s.block_table) for s in out.scheduled), default=0) or 1
    flat: list[int] = []
    for s in out.scheduled:
        flat.extend(s.block_table)
        flat.extend([0] * (width - len(s.block_table)))
    tables = torch.tensor(flat, dtype=torch.int32).view(len(out.scheduled), width).clamp_(min=0)
    host = HostBatch(
        input_ids,
        positions,
        slots,
        query_lens,
        context_lens,
        tables,
        logits_indices,
        out.block_copies,
        [lora_slot(s.seq) for s in out.scheduled] if lora_slot is not None else [],
        _multimodal(out) if multimodal else None,
    )
    return StepBatch(host, logits_rows, pending)
