"""A prompt with images becomes the tokens the model reads: each image's one placeholder token
(what a chat template writes for an image part) is replaced by the image's span, as the model's
Hugging Face processor expands it, and the image becomes an `ImageItem`.

What differs per model (its image processor, its span, its rotary positions) is its
`ImageProcessing`, provided by the model's file in engine/models/.
"""

from __future__ import annotations

import hashlib
import itertools
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
    # The text between placeholders; a processor that writes text around a span (Gemma 3's
    # "\n\n") may tokenize it with the whitespace beside it (`join_edges`).
    bounds = [-1, *where, len(prompt_ids)]
    texts = [prompt_ids[a + 1 : b] for a, b in itertools.pairwise(bounds)]
    join = getattr(processing, "join_edges", None)
    tokens: list[int] = []
    items: list[ImageItem] = []
    for i, image in enumerate(images):
        data = processing.preprocess(image)
        span = processing.span(data)
        before, after = texts[i], texts[i + 1]
        if join is not None:
            before, span, texts[i + 1] = join(before, span, after)
        tokens.extend(before)
        embeds = tuple(j for j, t in enumerate(span) if t == processing.embed_id)
        items.append(ImageItem(image_hash(image), len(tokens), len(span), embeds, data))
        tokens.extend(span)
    tokens.extend(texts[-1])
    rope = processing.rope_positions(tokens, items)
    positions, delta = rope if rope is not None else (None, 0)
    return tokens, MultiModalInputs(tuple(items), positions, delta)
