"""Decode steps replayed from CUDA graphs.

A decode step launches hundreds of small kernels whose launch cost, not their work, dominates
at small batch sizes. The model's forward for a batch of B one-token requests is captured once
per size of a ladder; a step of n <= B requests is padded up to the next captured size and
replayed. Everything a graph reads sits in static buffers that each step overwrites: token ids,
positions, cache slots, block tables and context lengths. Padded requests write nowhere (slot
-1) and read one key of block 0, so they cost a little work and change nothing.

A step uploads only the block-table columns its longest request uses: the buffer is as wide as
`max_model_len` allows (16 MB of int32 at 256 requests of an 8k-token model), and a request
reads no column past its own length, so what earlier, wider steps left there is never read.

With `capture=False` the same buffers feed the model eagerly: the padding is exercised where
there is no CUDA (tests) or the backend cannot be captured.
"""

from __future__ import annotations

import bisect

import torch

from engine.models.interface import CausalLM
from engine.worker.model_input import HostBatch, PinnedUpload
from kernels.attention import AttentionBackend, AttentionMetadata

LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: the ladder up to `max_num_seqs` (at most 512), which is included."""
    top = min(max_num_seqs, LADDER[-1])
    return [s for s in LADDER if s < top] + [top]


def pad_decode(batch: HostBatch, size: int, width: int) -> HostBatch:
    """`batch` (one query row per request) padded to `size` requests and `width` table columns."""
    pad = size - len(batch.query_lens)
    assert pad >= 0 and batch.block_tables.shape[1] <= width
    tables = torch.zeros((size, width), dtype=torch.int32)
    tables[: batch.block_tables.shape[0], : batch.block_tables.shape[1]] = batch.block_tables
    return HostBatch(
        input_ids=batch.input_ids + [0] * pad,
        positions=batch.positions + [0] * pad,
        slots=batch.slots + [-1] * pad,  # stores nothing
        query_lens=batch.query_lens + [1] * pad,
        context_lens=batch.context_lens + [1] * pad,  # reads slot 0 of block 0: any finite value
        block_tables=tables,
        logits_indices=batch.logits_indices,
        block_copies=batch.block_copies,
    )


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        capture: bool,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = graph_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        self.device = device
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.seqlens = torch.ones(top, dtype=torch.int32, device=device)
        self.tables = torch.zeros((top, self.width), dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(top + 1, dtype=torch.int32, device=device)  # one row each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def fits(self, batch: HostBatch) -> bool:
        reqs = len(batch.query_lens)
        return (
            0 < reqs <= self.sizes[-1]
            and max(batch.query_lens) == 1
            and batch.block_tables.shape[1] <= self.width
        )

    @torch.inference_mode()
    def run(self, batch: HostBatch, upload: PinnedUpload) -> torch.Tensor:
        """Hidden states of the rows in `batch.logits_indices`, by replay when the padded size was captured."""
        n = len(batch.query_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = batch.block_tables.shape[1]
        inp = pad_decode(batch, size, width).to_device(self.device, upload)
        self.input_ids[:size].copy_(inp.input_ids)
        self.positions[:size].copy_(inp.positions)
        self.slots[:size].copy_(inp.attn.slot_mapping)
        self.seqlens[:size].copy_(inp.attn.seqlens_k)
        self.tables[:size, :width].copy_(inp.attn.block_tables)
        graph = self.graphs.get(size)
        if graph is None:
            hidden = self._forward(size, inp.attn.context_lens)
        else:
            graph.replay()
            hidden = self.outputs[size]
        return hidden.index_select(
            0, inp.logits_indices
        )  # indices < n: padding rows are never picked

    def _forward(self, size: int, context_lens: list[int]) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            cu_seqlens_q=self.cu_seqlens[: size + 1],
            seqlens_k=self.seqlens[:size],
            query_lens=[1] * size,
            context_lens=context_lens,
        )
        return self.model(
            self.input_ids[:size], self.positions[:size], self.backend, self.kv_caches, meta
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool: only one graph's output is live at a time."""
        pool = None
        for size in reversed(self.sizes):
            # The buffers hold padding (slot -1, length 1): the warm-up compiles the kernels
            # outside the capture and writes nothing to the cache.
            self._forward(size, [1] * size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size, [1] * size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
