"""M-RoPE positions against transformers' `get_rope_index` (a method of Qwen2VLModel and
Qwen2_5_VLModel in transformers 5) on the real processor's prompts with 0, 1, 2 and 3 images
of different shapes, text around them or not."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
import torch

from engine.models.mrope import ImageSpan, mrope_positions
from tests.support.models import tokenizer_dir
from tests.support.qwen2_vl_models import (
    KINDS,
    hf_model_class,
    qwen_vl_config,
    random_image,
    reference_processor,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# (prompt, image sizes as (width, height)): wide (3x4 merge blocks), tall (4x2), one row (1x3)
CASES = {
    "text only": ("Hello there, how are you today?", []),
    "one image": (f"Look: {IMAGE} What is it?", [(112, 84)]),
    "two images": (f"First {IMAGE} then {IMAGE} compare them.", [(112, 84), (56, 112)]),
    "starts and ends with images": (
        f"{IMAGE} between {IMAGE}{IMAGE}",
        [(56, 112), (84, 28), (112, 84)],
    ),
}


@pytest.fixture(scope="module")
def processor():
    return reference_processor(tokenizer_dir("qwen"))


@cache
def _hf_model(kind: str):
    """transformers' Qwen2VLModel / Qwen2_5_VLModel, whose `get_rope_index` is the oracle."""
    return hf_model_class(kind)(qwen_vl_config(kind, vocab_size=256)).model


def _image_spans(input_ids: list[int], image_id: int, grids: torch.Tensor) -> list[ImageSpan]:
    """Each run of image tokens with its image's grid, in order."""
    offsets, index = [], 0
    for token, run in itertools.groupby(input_ids):
        count = len(list(run))
        if token == image_id:
            offsets.append(index)
        index += count
    assert len(offsets) == len(grids)
    return [ImageSpan(o, tuple(g)) for o, g in zip(offsets, grids.tolist(), strict=True)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_positions_equal_get_rope_index(processor, kind: str, case: str) -> None:
    text, sizes = CASES[case]
    images = [random_image(seed, size) for seed, size in enumerate(sizes)]
    inputs = processor(images=images or None, text=[text], return_tensors="pt")
    grids = inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
    expected, expected_delta = _hf_model(kind).get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=grids if images else None
    )
    ids = inputs["input_ids"][0].tolist()
    spans = _image_spans(ids, processor.image_token_id, grids)
    positions, delta = mrope_positions(len(ids), spans, merge_size=2)
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)
    if images:  # the case tests something: images make positions lag behind the indices
        assert delta < 0


def test_text_after_an_image_starts_past_its_larger_side() -> None:
    """Two text tokens, a 2x3-block image, one text token: the image's rows count from 2 on
    the height axis, its columns on the width axis; the text after it takes 2 + max(2, 3)."""
    positions, delta = mrope_positions(9, [ImageSpan(2, (1, 4, 6))], merge_size=2)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert delta == 6 - 9


def test_an_image_past_the_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="past the prompt"):
        mrope_positions(5, [ImageSpan(2, (1, 4, 6))], merge_size=2)
