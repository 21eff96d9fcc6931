"""Qwen2-VL's multimodal rotary positions (M-RoPE): each prompt token's (time, height, width)
position.

A text token's three positions are equal and count up by one per token. An image's tokens
(one per merged patch block) all start from the position the next text token would have had,
the time axis staying there (an image is one frame) while the height and width axes count the
block's row and column. The text after an image goes on from that start plus the larger of the
image's two block counts, so positions run out more slowly than tokens: a generated token's
position is its index plus the prompt's (negative) delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    offset: int  # the prompt index of the image's first token
    grid_thw: tuple[int, int, int]  # the image's patch grid, as the image processor gives it


def mrope_positions(
    length: int, images: Sequence[ImageSpan], merge_size: int
) -> tuple[torch.Tensor, int]:
    """([3, length] int64 positions, the delta a token after the prompt adds to its index) for
    a prompt of `length` tokens with `images` (in order, not overlapping) among its text."""
    columns: list[torch.Tensor] = []
    index = 0  # the next prompt token's index
    position = 0  # the position the next text token takes

    def text(count: int) -> None:
        nonlocal index, position
        columns.append(torch.arange(position, position + count).expand(3, -1))
        index, position = index + count, position + count

    for image in images:
        if image.offset < index:
            raise ValueError(f"image at {image.offset} overlaps the one before it")
        text(image.offset - index)
        t, h, w = image.grid_thw
        rows, cols = h // merge_size, w // merge_size
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij")
        )
        columns.append(grid.reshape(3, -1) + position)
        index += t * rows * cols
        position += max(rows, cols)
    if index > length:
        raise ValueError(f"images run to token {index}, past the prompt's {length}")
    text(length - index)
    positions = torch.cat(columns, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta
