"""A prompt with images becomes the tokens the model reads: each image's one placeholder token
(what a chat template writes for an image part) is replaced by the image's span, as the model's
Hugging Face processor expands it, and the image becomes an `ImageItem`.

What differs per model (its image processor, its span, its rotary positions) is its
`ImageProcessing`, provided by the model's file in engine/models/.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from engine.errors import InvalidRequestError
from engine.multimodal.inputs import ImageItem, MultiModalInputs

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageProcessing(Protocol):
    # The token a prompt holds where an image goes, before expansion (LLaVA's `<image>`).
    placeholder_id: int
    placeholder_text: str
    # The token of the span positions that take the encoder's rows.
    embed_id: int
    # The span's tokens attend to each other both ways (Gemma 3): computed in one chunk.
    whole_spans: bool

    def preprocess(self, image: Image) -> dict[str, torch.Tensor]:
        """One image's encoder inputs (the model's Hugging Face image processor)."""
        ...

    def span(self, data: dict[str, torch.Tensor]) -> list[int]:
        """The tokens that take the placeholder's place for an image with these inputs."""
        ...

    def rope_positions(
        self, token_ids: list[int], items: Sequence[ImageItem]
    ) -> tuple[torch.Tensor, int] | None:
        """Multimodal rotary positions [3, n] and the delta of the tokens after the prompt;
        None where a token's position is its index."""
        ...


def image_hash(image: Image) -> bytes:
    """The pixels' identity: two images hash alike only when every pixel is equal."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.digest()


def expand_images(
    processing: ImageProcessing, prompt_ids: list[int], images: Sequence[Image]
) -> tuple[list[int], MultiModalInputs]:
    """The prompt with each placeholder expanded into its image's span (in order), and the
    images as items. InvalidRequestError when placeholders and images do not pair up."""
    where = [i for i, t in enumerate(prompt_ids) if t == processing.placeholder_id]
    if len(where) != len(images):
        raise InvalidRequestError(
            f"the prompt holds {len(where)} image placeholder(s) "
            f"({processing.placeholder_text!r}) for {len(images)} image(s)",
            param="multi_modal_data",
        )
    tokens: list[int] = []
    items: list[ImageItem] = []
    previous = 0
    for at, image in zip(where, images, strict=True):
        tokens.extend(prompt_ids[previous:at])
        data = processing.preprocess(image)
        span = processing.span(data)
        embeds = tuple(i for i, t in enumerate(span) if t == processing.embed_id)
        items.append(ImageItem(image_hash(image), len(tokens), len(span), embeds, data))
        tokens.extend(span)
        previous = at + 1
    tokens.extend(prompt_ids[previous:])
    rope = processing.rope_positions(tokens, items)
    positions, delta = rope if rope is not None else (None, 0)
    return tokens, MultiModalInputs(tuple(items), positions, delta)
