"""A prompt's images as the engine holds them: where each one's placeholder span lies in the
prompt, what its encoder reads, and the content hash that names it in the encoder cache and in
the prefix cache's block hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    hash: bytes  # of the pixels the encoder reads (and the model it reads them for)
    offset: int  # the first prompt position of its span
    length: int  # positions in the span
    # Positions of the span (from `offset`) whose embeddings are the encoder's rows, in order;
    # the span's other tokens (a tile's markers, say) embed as text.
    embed_positions: tuple[int, ...]
    data: dict[str, torch.Tensor]  # the processor's outputs for this image alone

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return len(self.embed_positions)


@dataclass(frozen=True, eq=False)
class MultiModalInputs:
    items: tuple[ImageItem, ...]
    # Multimodal rotary positions (Qwen2-VL's M-RoPE), [3, prompt length]; None: a token's
    # position is its index. `rope_delta`: what a generated token's position adds to its index.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0

    def items_in(self, start: int, end: int) -> list[ImageItem]:
        """The images whose spans overlap prompt positions [start, end)."""
        return [item for item in self.items if item.offset < end and item.end > start]


@dataclass
class MultiModalStep:
    """What one forward reads: rows of the embeddings to replace, and with what."""

    rows: torch.Tensor  # [R] int64
    embeds: torch.Tensor  # [R, hidden]
    rope_positions: torch.Tensor | None  # [3, T]
    # (first row, end row, sequence index in the step) of each image wholly in the step.
    image_spans: list[tuple[int, int, int]] = field(default_factory=list)
