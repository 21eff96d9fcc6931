"""Gemma 3 end to end on the engine: prompts expanded as Gemma3Processor expands them, the
tower and projector equal to transformers', and greedy tokens equal to transformers' with one
image, two, and images across turns, under chunked prefill and a small KV pool, where the
soft tokens of an image attend to each other both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.support.gemma3_models import build_gemma3
from tests.support.vision_models import hf_vlm_greedy, sample_image

TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
ONE = TURN.format("what<start_of_image> is this")
TWO = TURN.format("compare<start_of_image> with<start_of_image> please")
TURNS = (
    TURN.format("look<start_of_image>")
    + "a cat<end_of_turn>\n"
    + TURN.format("and now<start_of_image>?")
)
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ARCH = "Gemma3ForConditionalGeneration"


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 1: weights under which the causal-only answers differ within a few tokens (the
    # logits differ under any seed, the greedy tokens not always).
    return build_gemma3(tmp_path_factory.mktemp("gemma3"), seed=1)


def _engine(folder: Path) -> LLM:
    # Spans of 8 tokens (4 soft ones) in chunks of at most 11: most chunks stop short of an
    # image to keep it whole; blocks of 4 and a pool of 40 blocks; a window of 6 in layer 0.
    return LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=11,
        block_size=4,
        num_kv_blocks=40,
        enable_prefix_caching=True,
        attention_backend="torch",
    )


@pytest.fixture(scope="module")
def llm(gemma3_dir: Path) -> LLM:
    with _engine(gemma3_dir) as llm:
        yield llm


def _prompt(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def _processing(folder: Path):
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.registry import image_processing_of

    return image_processing_of(ARCH)(
        AutoConfig.from_pretrained(folder), folder, AutoTokenizer.from_pretrained(folder)
    )


def test_placeholders_expand_as_the_processor_expands_them(gemma3_dir: Path) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    from engine.multimodal.processing import expand_images

    processing = _processing(gemma3_dir)
    images = [sample_image(1), sample_image(2, (64, 30))]
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ids, mm = expand_images(processing, tok(TWO)["input_ids"], images)
    want = AutoProcessor.from_pretrained(gemma3_dir, backend="pil")(
        images=images, text=[TWO], return_tensors="pt"
    )
    assert ids == want["input_ids"][0].tolist()
    # The soft tokens are the embedding rows, and the rows transformers marks as image ones.
    soft = [i for i, t in enumerate(ids) if t == processing.embed_id]
    assert [item.offset + j for item in mm.items for j in item.embed_positions] == soft
    assert soft == [i for i, t in enumerate(want["token_type_ids"][0].tolist()) if t == 1]
    assert [item.length for item in mm.items] == [8, 8]  # \n\n boi 4 x soft eoi \n\n
    assert torch.equal(
        torch.cat([item.data["pixel_values"] for item in mm.items]), want["pixel_values"]
    )


def test_image_embeddings_equal_transformers(llm: LLM, gemma3_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from engine.multimodal.processing import expand_images

    processing = _processing(gemma3_dir)
    _, mm = expand_images(processing, [processing.placeholder_id], [sample_image(3)])
    ours = llm.engine.executor.runner.model.encode_image(mm.items[0])
    hf = AutoModelForImageTextToText.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.get_image_features(mm.items[0].data["pixel_values"]).pooler_output
    assert ours.shape == (4, 64)
    torch.testing.assert_close(ours, want[0], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_equal_transformers_with_images(llm: LLM, gemma3_dir: Path) -> None:
    cases = [
        (ONE, [sample_image(1)]),
        (TWO, [sample_image(2), sample_image(3, (30, 64))]),
        (TURNS, [sample_image(4), sample_image(1)]),
        (ONE, [sample_image(5)]),
    ]
    # All at once: the steps mix chunks of different requests' images.
    outs = llm.generate([_prompt(t, imgs) for t, imgs in cases], GREEDY)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_vlm_greedy(gemma3_dir, text, images, MAX_TOKENS)
    assert llm.engine.kv.pool.num_free == 40  # every block back in the pool
    cache = llm.engine.scheduler.encoder
    assert cache is not None and not any(cache.readers.values())  # no image still pinned


def _hf_causal_greedy(folder: Path, text: str, images: list) -> list[int]:
    """transformers' greedy tokens with every token attending causally: the processor's
    inputs without the token types that mark the image tokens."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    inputs = AutoProcessor.from_pretrained(folder, backend="pil")(
        images=images, text=[text], return_tensors="pt"
    )
    del inputs["token_type_ids"]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_soft_tokens_attending_both_ways_change_the_answer(
    llm: LLM, gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the both-ways rows the engine gives transformers' causal-only tokens, and
    those differ from the real ones: the test above could not pass with a causal mask."""
    from engine.models import gemma3_vl

    images = [sample_image(20), sample_image(21, (30, 64))]  # never seen: no cached blocks
    monkeypatch.setattr(gemma3_vl, "ImagesBothWays", lambda backend, spans: backend)
    (causal,) = llm.generate([_prompt(TWO, images)], GREEDY)
    assert causal.outputs[0].token_ids == _hf_causal_greedy(gemma3_dir, TWO, images)
    assert causal.outputs[0].token_ids != hf_vlm_greedy(gemma3_dir, TWO, images, MAX_TOKENS)


def test_a_repeated_prompt_reads_its_images_blocks_from_the_prefix_cache(
    llm: LLM, gemma3_dir: Path
) -> None:
    images = [sample_image(30)]
    first, again = llm.generate([_prompt(ONE, images)], GREEDY) + llm.generate(
        [_prompt(ONE, images)], GREEDY
    )
    assert again.num_cached_tokens > first.num_cached_tokens
    want = hf_vlm_greedy(gemma3_dir, ONE, images, MAX_TOKENS)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want


def test_the_cpu_backend_with_a_budget_of_one_span(gemma3_dir: Path) -> None:
    """The both-ways rows over the C++ CPU backend's attention, each image's span filling a
    whole step of 8 tokens."""
    cases = [(TWO, [sample_image(40), sample_image(41, (64, 30))]), (ONE, [sample_image(42)])]
    with LLM(
        str(gemma3_dir),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=8,
        block_size=16,
        attention_backend="cpu",
    ) as cpu:
        assert cpu.engine.executor.runner.backend.name == "cpu"
        outs = cpu.generate([_prompt(t, imgs) for t, imgs in cases], GREEDY)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_vlm_greedy(gemma3_dir, text, images, MAX_TOKENS)


def test_an_image_span_larger_than_a_step_is_refused(gemma3_dir: Path) -> None:
    """A span is computed in one step: one longer than the step's budget never could be."""
    with LLM(str(gemma3_dir), dtype="float32", max_model_len=64, max_num_batched_tokens=7) as lm:
        with pytest.raises(InvalidRequestError, match="takes 8 prompt tokens, computed in one"):
            lm.generate(_prompt(ONE, [sample_image(1)]), GREEDY)
        assert not lm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("checkpoint", "ours"),
    [
        # Gemma 3's published layout, then transformers 5's.
        (
            "vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight",
            "vision_tower.encoder.layers.1.mlp.fc1.weight",
        ),
        (
            "model.vision_tower.vision_model.post_layernorm.bias",
            "vision_tower.post_layernorm.bias",
        ),
        (
            "multi_modal_projector.mm_input_projection_weight",
            "multi_modal_projector.mm_input_projection_weight",
        ),
        (
            "language_model.model.layers.1.self_attn.k_norm.weight",
            "layers.1.self_attn.k_norm.weight",
        ),
        (
            "model.language_model.layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.qkv_proj.weight",
        ),
    ],
)
def test_checkpoint_names_of_both_layouts_load(llm: LLM, checkpoint: str, ours: str) -> None:
    model = llm.engine.executor.runner.model
    located = model._locate(checkpoint)
    assert located is not None and located[0] == ours
    assert ours in dict(model.named_parameters())


@pytest.mark.parametrize(
    "text",
    [
        "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n",  # the template's own
        "what <start_of_image>\nand <start_of_image> \n",  # spaces and newlines on both sides
    ],
)
def test_whitespace_beside_an_image_merges_as_the_processor_merges_it(
    gemma3_dir: Path, text: str
) -> None:
    """The processor writes "\\n\\n" around each image as text: a newline or space beside the
    placeholder tokenizes together with it ("\\n" + "\\n\\n" is one "\\n\\n\\n")."""
    from transformers import AutoProcessor, AutoTokenizer

    from engine.multimodal.processing import expand_images

    images = [sample_image(1), sample_image(2)][: text.count("<start_of_image>")]
    processing = _processing(gemma3_dir)
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ids, mm = expand_images(processing, tok(text)["input_ids"], images)
    want = AutoProcessor.from_pretrained(gemma3_dir, backend="pil")(
        images=images, text=[text], return_tensors="pt"
    )
    assert ids == want["input_ids"][0].tolist()
    soft = [i for i, t in enumerate(want["token_type_ids"][0].tolist()) if t == 1]
    assert [item.offset + j for item in mm.items for j in item.embed_positions] == soft
