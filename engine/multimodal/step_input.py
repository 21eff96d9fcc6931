"""A step's image rows: on the host, which batch rows take which image's encoder output (and
the multimodal rotary positions, where the model has them); on the runner, the encoder
outputs kept between steps and the tensors one forward reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.multimodal.inputs import ImageItem, MultiModalInputs, MultiModalStep


@dataclass
class MultiModalBatch:
    encode: list[ImageItem]  # images to encode before the forward
    evicted: list[bytes]  # encoder outputs to drop
    rows: list[int]  # batch rows whose embedding is an encoder output row
    sources: list[tuple[bytes, int]]  # per such row: (image hash, row of that image's output)
    rope_positions: torch.Tensor | None  # [3, num_tokens], int64; None: positions as given
    # Per image whose every embedding row is in this step: (first row, end row, the index of
    # its sequence in the step): what attends both ways where the model's images do.
    image_spans: list[tuple[int, int, int]]


@dataclass(frozen=True)
class Chunk:
    """One scheduled sequence's tokens in the step, in batch order."""

    mm: MultiModalInputs | None
    start: int  # its first position computed
    end: int
    num_prompt: int


def multimodal_batch(
    chunks: list[Chunk], encode: list[ImageItem], evicted: list[bytes]
) -> MultiModalBatch | None:
    """None for a step with no image anywhere (no rows, nothing to encode or drop)."""
    rows: list[int] = []
    sources: list[tuple[bytes, int]] = []
    spans: list[tuple[int, int, int]] = []
    any_rope = any(c.mm is not None and c.mm.rope_positions is not None for c in chunks)
    rope_columns: list[torch.Tensor] = []
    row0 = 0
    for index, c in enumerate(chunks):
        if c.mm is not None:
            for item in c.mm.items_in(c.start, c.end):
                first = len(rows)
                for j, offset in enumerate(item.embed_positions):
                    position = item.offset + offset
                    if c.start <= position < c.end:
                        rows.append(row0 + position - c.start)
                        sources.append((item.hash, j))
                if len(rows) - first == item.num_embeds:
                    spans.append((rows[first], rows[-1] + 1, index))
        if any_rope:
            rope_columns.append(_rope_columns(c.mm, c.start, c.end, c.num_prompt))
        row0 += c.end - c.start
    if not rows and not encode and not evicted and not any_rope:
        return None
    rope = torch.cat(rope_columns, dim=1) if any_rope else None
    return MultiModalBatch(list(encode), list(evicted), rows, sources, rope, spans)


def _rope_columns(
    mm: MultiModalInputs | None, start: int, end: int, num_prompt: int
) -> torch.Tensor:
    """[3, end - start] positions: the prompt's own multimodal ones, and each later token's
    index plus the prompt's delta on all three axes (a text prompt's: its indices)."""
    positions = torch.arange(start, end, dtype=torch.int64).expand(3, -1).clone()
    if mm is None or mm.rope_positions is None:
        return positions
    if start < num_prompt:
        upto = min(end, num_prompt)
        positions[:, : upto - start] = mm.rope_positions[:, start:upto]
    if end > num_prompt:
        positions[:, max(start, num_prompt) - start :] += mm.rope_delta
    return positions


class EncoderOutputs:
    """The runner's encoder outputs by image hash, kept until the scheduler evicts them."""

    def __init__(self) -> None:
        self.outputs: dict[bytes, torch.Tensor] = {}

    def prepare(
        self,
        batch: MultiModalBatch,
        encode: Callable[[ImageItem], torch.Tensor],
        device: torch.device,
    ) -> MultiModalStep:
        for key in batch.evicted:
            self.outputs.pop(key, None)
        for item in batch.encode:
            output = encode(item)
            if output.shape[0] != item.num_embeds:
                raise RuntimeError(
                    f"the encoder gave {output.shape[0]} rows for an image whose span holds "
                    f"{item.num_embeds} image tokens"
                )
            self.outputs[item.hash] = output
        if batch.sources:
            embeds = torch.stack([self.outputs[key][j] for key, j in batch.sources])
        else:
            embeds = torch.empty(0)
        rope = None if batch.rope_positions is None else batch.rope_positions.to(device)
        rows = torch.tensor(batch.rows, dtype=torch.int64, device=device)
        return MultiModalStep(rows, embeds, rope, batch.image_spans)
