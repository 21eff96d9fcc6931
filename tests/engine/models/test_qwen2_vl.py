"""Qwen2-VL and Qwen2.5-VL end to end: greedy tokens equal transformers' `generate` (its
Qwen2VLProcessor's inputs, float32) for prompts with one image, two images, and images in two
turns of a conversation, batched with a text-only prompt; under plain batching, prefill chunked
into many steps, a KV pool so small that requests are preempted and recomputed, and prompts read
back from the prefix cache. Our expansion of the image placeholders equals Qwen2VLProcessor's,
and both checkpoint layouts load alike.

Every generation runs 40 tokens past a prompt whose images leave its positions well behind its
indices: a generated token rotated by its index rather than its index plus the prompt's delta
gives other tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.distributed.shard import WHOLE
from engine.errors import InvalidRequestError
from engine.models.registry import model_class, resolve_architecture
from tests.support.qwen2_vl_models import (
    KINDS,
    build_qwen_vl,
    hf_qwen_vl_greedy,
    random_image,
    reference_processor,
)

MAX_NEW = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

WIDE, TALL = random_image(1, (112, 84)), random_image(2, (56, 112))  # 12 and 8 image tokens


def _image(image: Image.Image) -> dict:
    return {"type": "image", "image": image}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


# name -> (chat messages, their images in order)
CONVERSATIONS: dict[str, tuple[list[dict], list[Image.Image]]] = {
    "one image": (
        [{"role": "user", "content": [_image(WIDE), _text("What is in this picture?")]}],
        [WIDE],
    ),
    "two images": (
        [
            {
                "role": "user",
                "content": [_text("Compare"), _image(TALL), _text("with"), _image(WIDE)],
            }
        ],
        [TALL, WIDE],
    ),
    "two turns": (
        [
            {"role": "user", "content": [_image(WIDE), _text("Describe it.")]},
            {"role": "assistant", "content": "A field of coloured noise."},
            {"role": "user", "content": [_text("And this one?"), _image(TALL)]},
        ],
        [WIDE, TALL],
    ),
    "text only": ([{"role": "user", "content": "Say something about pictures."}], []),
}

REGIMES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16},
    # 12 blocks of 8 tokens for four prompts of ~30-50 tokens and 40 new tokens each
    "tiny_pool": {"num_kv_blocks": 12, "block_size": 8, "max_model_len": 96},
    # The batch runs twice: the second time its prompts start from cached blocks that hold
    # image tokens, so the first positions computed are well into the M-RoPE positions.
    "prefix_cache": {"enable_prefix_caching": True, "block_size": 8},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Callable[[str], Path]:
    """Each kind's model folder, built when a test first asks for it."""
    built: dict[str, Path] = {}

    def folder(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_qwen_vl(tmp_path_factory.mktemp(kind), kind, seed=5)
        return built[kind]

    return folder


@pytest.fixture(scope="module", params=KINDS)
def model(request, folders) -> tuple[str, Path]:
    return request.param, folders(request.param)


_oracle: dict[tuple[str, str], tuple[str, list[int], list[int]]] = {}


def oracle(kind: str, folder: Path, name: str) -> tuple[str, list[int], list[int]]:
    """(prompt text, the processor's prompt ids, transformers' greedy tokens), once each."""
    key = (str(folder), name)
    if key not in _oracle:
        messages, images = CONVERSATIONS[name]
        tok = reference_processor(folder).tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, tokens = hf_qwen_vl_greedy(folder, kind, text, images, MAX_NEW)
        _oracle[key] = (text, ids, tokens)
    return _oracle[key]


# Preemption is the engine's and the same for both: it runs once, on Qwen2-VL.
CASES = [("qwen2_vl", regime) for regime in REGIMES] + [
    ("qwen2_5_vl", "default"),
    ("qwen2_5_vl", "chunked"),
]


@pytest.mark.parametrize(("kind", "regime"), CASES)
def test_greedy_tokens_equal_transformers(folders, kind: str, regime: str) -> None:
    folder = folders(kind)
    names = list(CONVERSATIONS)
    expected = {name: oracle(kind, folder, name) for name in names}
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, **REGIMES[regime])
    prompts = [
        {"prompt": expected[name][0], "multi_modal_data": {"image": CONVERSATIONS[name][1]}}
        for name in names
    ]
    for run in range(2 if regime == "prefix_cache" else 1):
        outputs = llm.generate(prompts, GREEDY)
        for name, out in zip(names, outputs, strict=True):
            _, prompt_ids, tokens = expected[name]
            assert out.prompt_token_ids == prompt_ids, f"{name}: the expanded prompt differs"
            assert out.outputs[0].token_ids == tokens, f"{name}: tokens differ (run {run})"
    stats = llm.last_run_stats
    if regime == "tiny_pool":
        assert stats.num_preemptions > 0, "the pool was meant to be too small"
    if regime == "prefix_cache":
        image_prompts = sum(len(expected[n][1]) for n in names if CONVERSATIONS[n][1])
        # every image prompt's whole blocks, short of the last token that is always recomputed
        assert stats.prefix_cache_hits >= image_prompts - 3 * 8, stats


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(str(model[1]), dtype="float32")


def test_placeholders_expand_as_the_processor_does(model, llm: LLM) -> None:
    """Our expansion of each `<|image_pad|>` equals Qwen2VLProcessor's, for images whose grids
    differ in both sides (and so in their token counts)."""
    folder = model[1]
    images = [random_image(7, (28, 84)), WIDE, random_image(8, (84, 56))]
    text = "".join(f"Image {i}: <|vision_start|><|image_pad|><|vision_end|>\n" for i in range(3))
    ids, mm = llm.engine.expand_images(text, images)
    expected = reference_processor(folder)(images=images, text=[text], return_tensors="pt")
    assert ids == expected["input_ids"][0].tolist()
    assert [item.num_embeds for item in mm.items] == [3, 12, 6]
    assert mm.rope_positions is not None and mm.rope_delta < 0


def test_more_images_than_placeholders_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate(
            [
                {
                    "prompt": "<|vision_start|><|image_pad|><|vision_end|>",
                    "multi_modal_data": {"image": [WIDE, TALL]},
                }
            ],
            GREEDY,
        )


def test_both_checkpoint_layouts_load_alike(model) -> None:
    """transformers 5 saves `model.layers` beside `visual`; other checkpoints put them under
    `model.language_model` and `model.visual`: each tensor lands on the same parameter."""
    folder = model[1]
    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        ours = model_class(resolve_architecture(cfg))(cfg, WHOLE)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("visual.") for n in names)
    assert any(n.startswith("model.layers.") for n in names)
    params = dict(ours.named_parameters())
    for name in names:
        if name.startswith("visual."):
            newer = "model." + name
        elif name.startswith("model."):
            newer = "model.language_model." + name.removeprefix("model.")
        else:
            newer = name
        target = ours._locate(name)
        assert target is not None and target[0] in params, name
        assert ours._locate(newer) == target, newer
