"""Idefics3 and SmolVLM end to end on the engine: a prompt's `<image>` expanded into tiles as
Idefics3Processor expands it, and greedy tokens equal to transformers' with one image, several,
and images across turns, under chunked prefill and a small KV pool; tiling off, a wider pixel
shuffle, and the head tied as transformers ties it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.idefics3_models import build_idefics3, hf_greedy_on_ids
from tests.support.vision_models import hf_vlm_greedy, sample_image

TURN = "<|user|>:{}<end_of_utterance>\n<|assistant|>:"
ONE = TURN.format("what <image> is this")
TWO = TURN.format("compare <image> with <image> please")
TURNS = TURN.format("look <image>") + "a cat<end_of_utterance>\n" + TURN.format("and <image>?")
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ARCH = "Idefics3ForConditionalGeneration"


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def unsplit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """No tiling (the global view alone) and a 4x4 pixel shuffle: one row per image."""
    return build_idefics3(
        tmp_path_factory.mktemp("idefics3_unsplit"), seed=1, splitting=False, scale_factor=4
    )


@pytest.fixture(scope="module")
def llm(idefics3_dir: Path) -> LLM:
    # Chunks of 7 tokens cut through tiles and their markers; blocks of 4 and a pool of 32
    # blocks (the 128 tokens of one request at its longest) make preemption part of the run.
    with LLM(
        str(idefics3_dir),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=7,
        block_size=4,
        num_kv_blocks=32,
        enable_prefix_caching=True,
        attention_backend="torch",
    ) as llm:
        yield llm


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


@pytest.mark.parametrize("splitting", [True, False])
def test_placeholders_expand_as_the_processor_expands_them(
    idefics3_dir: Path, unsplit_dir: Path, splitting: bool
) -> None:
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from engine.models.registry import image_processing_of
    from engine.multimodal.processing import expand_images

    folder = idefics3_dir if splitting else unsplit_dir
    tok = AutoTokenizer.from_pretrained(folder)
    processing = image_processing_of(ARCH)(AutoConfig.from_pretrained(folder), folder, tok)
    # 2x2 tiles, 1x2 and 2x1 (with splitting), each plus the global view.
    images = [sample_image(1), sample_image(2, (64, 30)), sample_image(3, (30, 64))]
    text = TURN.format("<image> then <image> and <image>")
    ids, mm = expand_images(processing, tok(text)["input_ids"], images)
    want = AutoProcessor.from_pretrained(folder, backend="pil")(
        images=images, text=[text], return_tensors="pt"
    )
    assert ids == want["input_ids"][0].tolist()
    tiles = [item.data["pixel_values"].shape[0] for item in mm.items]
    assert tiles == ([5, 3, 3] if splitting else [1, 1, 1])
    assert torch.equal(
        torch.cat([item.data["pixel_values"] for item in mm.items]), want["pixel_values"][0]
    )
    # Only the `<image>` positions take encoder rows (4 per tile after a 2x2 shuffle, 1 after
    # a 4x4 one), none for the markers.
    image_positions = [i for i, t in enumerate(ids) if t == processing.embed_id]
    assert [item.offset + p for item in mm.items for p in item.embed_positions] == image_positions
    per_tile = 4 if splitting else 1
    assert [item.num_embeds for item in mm.items] == [per_tile * n for n in tiles]
    fake = tok.convert_tokens_to_ids("<fake_token_around_image>")
    for item in mm.items:  # each span opens and closes on a tile marker
        assert ids[item.offset] == ids[item.end - 1] == fake


def test_greedy_tokens_equal_transformers_with_images(llm: LLM, idefics3_dir: Path) -> None:
    cases = [
        (ONE, [sample_image(1)]),
        (TWO, [sample_image(2, (64, 30)), sample_image(3, (30, 64))]),
        (TURNS, [sample_image(4), sample_image(1)]),
        (ONE, [sample_image(5, (30, 64))]),
    ]
    # All at once: the steps mix chunks of different requests' tiles.
    outs = llm.generate([_prompt(t, imgs) for t, imgs in cases], GREEDY)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_vlm_greedy(idefics3_dir, text, images, MAX_TOKENS)
    assert llm.last_run_stats.num_preemptions > 0  # 247 prompt tokens in a pool of 128
    assert llm.engine.kv.pool.num_free == 32  # every block back in the pool
    cache = llm.engine.scheduler.encoder
    assert cache is not None and not any(cache.readers.values())  # no image still pinned


def test_the_same_text_with_another_image_gets_that_images_answer(
    llm: LLM, idefics3_dir: Path
) -> None:
    first, again, other = llm.generate([_prompt(ONE, [sample_image(7)])], GREEDY) + llm.generate(
        [_prompt(ONE, [sample_image(7)]), _prompt(ONE, [sample_image(8)])], GREEDY
    )
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens > first.num_cached_tokens  # its image's blocks were found
    # Same span tokens, another image: no block past the span's start may hit.
    fake = llm.engine.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    image_start = other.prompt_token_ids.index(fake)
    assert other.num_cached_tokens <= image_start
    assert other.outputs[0].token_ids == hf_vlm_greedy(
        idefics3_dir, ONE, [sample_image(8)], MAX_TOKENS
    )


def test_unsplit_images_with_a_wider_pixel_shuffle(unsplit_dir: Path) -> None:
    images = [sample_image(6), sample_image(9, (64, 30))]
    with LLM(str(unsplit_dir), dtype="float32", max_model_len=64, attention_backend="torch") as llm:
        (out,) = llm.generate(_prompt(TWO, images), GREEDY)
    assert out.outputs[0].token_ids == hf_vlm_greedy(unsplit_dir, TWO, images, MAX_TOKENS)


def test_smolvlm_lays_out_spans_as_idefics3_and_answers_as_transformers(
    tmp_path: Path, idefics3_dir: Path
) -> None:
    """SmolVLMForConditionalGeneration (SmolVLM2's class): the same spans as Idefics3Processor
    makes for the same tokenizer and tile shape, and transformers' SmolVLM tokens on them."""
    from transformers import AutoProcessor

    folder = build_idefics3(tmp_path, seed=2, kind="smolvlm")
    images = [sample_image(10), sample_image(12, (64, 30))]
    with LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=7,
        attention_backend="torch",
    ) as llm:
        (out,) = llm.generate(_prompt(TWO, images), GREEDY)
    want = AutoProcessor.from_pretrained(idefics3_dir, backend="pil")(
        images=images, text=[TWO], return_tensors="pt"
    )
    assert out.prompt_token_ids == want["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_greedy_on_ids(
        folder, out.prompt_token_ids, images, MAX_TOKENS
    )


@pytest.mark.parametrize("tie", [(True, False), (False, True)])
def test_the_head_is_tied_as_the_top_level_config_says(
    tmp_path: Path, tie: tuple[bool, bool]
) -> None:
    """transformers ties by the top-level flag: tied, the checkpoint holds no lm_head; untied,
    its own lm_head, whatever the text config says."""
    folder = build_idefics3(tmp_path, seed=3, splitting=False, scale_factor=4, tie=tie)
    images = [sample_image(13)]
    with LLM(str(folder), dtype="float32", max_model_len=64, attention_backend="torch") as llm:
        (out,) = llm.generate(_prompt(ONE, images), GREEDY)
    assert out.outputs[0].token_ids == hf_vlm_greedy(folder, ONE, images, MAX_TOKENS)
