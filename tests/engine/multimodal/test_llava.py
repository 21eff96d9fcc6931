"""LLaVA end to end on the engine: its prompts expanded as LlavaProcessor expands them, and
greedy tokens equal to transformers' with one image, several, and images across turns, under
chunked prefill and a small KV pool; the image-keyed prefix cache and the encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.support.vision_models import build_llava, hf_vlm_greedy, sample_image

TURN = "<|user|>\n{}\n<|assistant|>\n"
ONE = TURN.format("what <image> is this")
TWO = TURN.format("compare <image> with <image> please")
TURNS = TURN.format("look <image>") + "a cat\n" + TURN.format("and now <image>?")
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llm(llava_dir: Path) -> LLM:
    # Chunks of 6 tokens cut through the 4-token image spans; blocks of 4 and a pool of 40
    # blocks make the prefix cache and preemption part of the run.
    with LLM(
        str(llava_dir),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=6,
        block_size=4,
        num_kv_blocks=40,
        enable_prefix_caching=True,
        attention_backend="torch",
    ) as llm:
        yield llm


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_placeholders_expand_as_the_processor_expands_them(
    tmp_path: Path, llava_dir: Path, strategy: str
) -> None:
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from engine.models.registry import image_processing_of
    from engine.multimodal.processing import expand_images

    # The class token is one more image token under "full".
    folder = llava_dir if strategy == "default" else build_llava(tmp_path, strategy=strategy)
    processing = image_processing_of("LlavaForConditionalGeneration")(
        AutoConfig.from_pretrained(folder), folder, AutoTokenizer.from_pretrained(folder)
    )
    images = [sample_image(1), sample_image(2, (64, 30))]
    tok = AutoTokenizer.from_pretrained(folder)
    ids, mm = expand_images(processing, tok(TWO)["input_ids"], images)
    want = AutoProcessor.from_pretrained(folder, backend="pil")(
        images=images, text=[TWO], return_tensors="pt"
    )
    assert ids == want["input_ids"][0].tolist()
    assert [item.offset for item in mm.items] == [
        i for i, t in enumerate(ids) if t == processing.embed_id
    ][:: len(mm.items[0].embed_positions)]
    assert torch.equal(
        torch.cat([item.data["pixel_values"] for item in mm.items]), want["pixel_values"]
    )
    assert mm.items[0].hash != mm.items[1].hash


def test_greedy_tokens_equal_transformers_with_images(llm: LLM, llava_dir: Path) -> None:
    cases = [
        (ONE, [sample_image(1)]),
        (TWO, [sample_image(2), sample_image(3, (30, 64))]),
        (TURNS, [sample_image(4), sample_image(1)]),
        (ONE, [sample_image(5)]),
    ]
    # All at once: the steps mix chunks of different requests' images.
    outs = llm.generate([_prompt(t, imgs) for t, imgs in cases], GREEDY)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_vlm_greedy(llava_dir, text, images, MAX_TOKENS)
    assert llm.engine.kv.pool.num_free == 40  # every block back in the pool
    cache = llm.engine.scheduler.encoder
    assert cache is not None and not any(cache.readers.values())  # no image still pinned


def test_the_same_text_with_another_image_gets_that_images_answer(
    llm: LLM, llava_dir: Path
) -> None:
    first, again, other = llm.generate([_prompt(ONE, [sample_image(7)])], GREEDY) + llm.generate(
        [_prompt(ONE, [sample_image(7)]), _prompt(ONE, [sample_image(8)])], GREEDY
    )
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens > first.num_cached_tokens  # its image's blocks were found
    # Same placeholder tokens, another image: no block past the image's start may hit.
    image_start = next(i for i, t in enumerate(other.prompt_token_ids) if t == 128257)
    assert other.num_cached_tokens <= image_start
    assert other.outputs[0].token_ids == hf_vlm_greedy(
        llava_dir, ONE, [sample_image(8)], MAX_TOKENS
    )


def test_a_repeated_image_is_encoded_once(llm: LLM) -> None:
    image = sample_image(11)
    llm.generate([_prompt(TWO, [image, image])], GREEDY)
    stats = llm.last_run_stats
    # Both spans read the one output: the second finds it cached.
    assert (stats.mm_cache_queries, stats.mm_cache_hits, stats.mm_images_encoded) == (2, 1, 1)
    assert len(stats.mm_preprocessing_seconds) == 1  # one prompt's images preprocessed


def test_images_and_placeholders_must_pair_up(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"holds 2 image placeholder\(s\).*1 image"):
        llm.generate(_prompt(TWO, [sample_image(1)]), GREEDY)
    with pytest.raises(InvalidRequestError, match=r"takes \{'image'"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"video": []}}, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_an_image_larger_than_the_encoder_cache_is_refused(llava_dir: Path) -> None:
    with LLM(str(llava_dir), dtype="float32", max_model_len=64, encoder_cache_size=3) as small:
        with pytest.raises(InvalidRequestError, match="needs 4 encoder rows, more than"):
            small.generate(_prompt(ONE, [sample_image(1)]), GREEDY)
        assert not small.engine.has_unfinished_requests()


def test_a_cache_of_one_image_encodes_them_one_step_at_a_time(
    llava_dir: Path,
) -> None:
    """Room for one image's rows: the chunk stops before the second image until the first
    is computed past and evicted, and the tokens are still transformers'."""
    images = [sample_image(2), sample_image(3, (30, 64))]
    with LLM(str(llava_dir), dtype="float32", max_model_len=64, encoder_cache_size=4) as one:
        (out,) = one.generate(_prompt(TWO, images), GREEDY)
        cache = one.engine.scheduler.encoder
        assert cache is not None and cache.queries == 2 and cache.hits == 0
    assert out.outputs[0].token_ids == hf_vlm_greedy(llava_dir, TWO, images, MAX_TOKENS)


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    from tests.support.models import build_random_model

    folder = build_random_model(tmp_path, "llama", "llama", vocab_size=512)
    with (
        LLM(str(folder), dtype="float32", max_model_len=64) as text_only,
        pytest.raises(InvalidRequestError, match="reads no images"),
    ):
        text_only.generate(_prompt("hi <image>", [sample_image(1)]), GREEDY)


def test_the_docs_example_runs(llava_dir: Path, tmp_path: Path) -> None:
    from tests.support.readme import python_examples

    example = python_examples("Image input", page="image-input.md")[0]  # the offline one
    sample_image(3).save(tmp_path / "cat.png")
    source = example.replace("/models/llava", str(llava_dir)).replace(
        '"cat.png"', repr(str(tmp_path / "cat.png"))
    )
    scope: dict = {}
    exec(source, scope)  # the docs page's own code
    (out,) = scope["out"]
    assert len(out.outputs[0].token_ids) == 32 and out.outputs[0].finish_reason == "length"


def test_token_id_prompts_take_images_as_text_prompts_do(llm: LLM) -> None:
    images = [sample_image(2), sample_image(3, (30, 64))]
    ids = llm.tokenizer(TWO)["input_ids"]
    by_text, by_ids = llm.generate(
        [_prompt(TWO, images), {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
        GREEDY,
    )
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids  # expanded alike
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
