"""Tiny random-weight Qwen2-VL and Qwen2.5-VL models, saved as Hugging Face folders with the
Qwen3 tokenizer (it has the vision tokens, with the same ids) and the PIL image processor, and
transformers' own Qwen2VLProcessor to compare with.

Qwen2VLProcessor wants a video processor, which needs torchvision (not installed here); images
never reach it, so `reference_processor` gives it a stand-in that only has the merge size the
processor reads.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.support.models import tokenizer_dir

KINDS = ("qwen2_vl", "qwen2_5_vl")

# Qwen2-VL's published template, cut to what the tests send: each image part becomes
# <|vision_start|><|image_pad|><|vision_end|> where it stands among the text parts.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Images of 28 to 112 pixels a side keep the grids at a few dozen patches.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112


def random_image(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB image of `size` (width, height): each seed its own pixels."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _text_config(vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        # head_dim 16: 8 rotated pairs split 2 (time) / 3 (rows) / 3 (columns)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
    }


def qwen_vl_config(kind: str, vocab_size: int):
    """A tiny config of `kind`: two text layers of width 64 and a two-block tower of width 32.
    Qwen2.5-VL's windows are 56 pixels (2x2 merge blocks) and its second block attends to the
    whole image, so that 84x112 images have whole and cut-off windows."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = _text_config(vocab_size)
    common = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if kind == "qwen2_vl":
        vision = {**common, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
        return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if kind == "qwen2_5_vl":
        vision = {
            **common,
            "hidden_size": 32,
            "out_hidden_size": 64,
            "intermediate_size": 48,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        }
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    raise ValueError(kind)


def hf_model_class(kind: str):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    return {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    }[kind]


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def build_qwen_vl(folder: Path, kind: str, seed: int = 0) -> Path:
    """Save a random-weight model of `kind` with the Qwen3 tokenizer, a chat template that
    places images, and the image processor's settings into `folder`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen"))
    cfg = qwen_vl_config(kind, len(tok))
    cfg.eos_token_id = cfg.text_config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = hf_model_class(kind)(cfg)
    with torch.no_grad():  # norms and biases start at 1 and 0: randomize them so loading shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return folder


class _StandInVideoProcessor:
    """All Qwen2VLProcessor reads of a video processor when no video is given."""

    merge_size = 2


@cache
def reference_processor(folder: Path):
    """transformers' Qwen2VLProcessor (Qwen2.5-VL's differs only for videos) over the saved
    tokenizer and image processor; one per folder, since reading the 150k-token tokenizer takes
    seconds and calling the processor changes nothing in it."""
    from transformers import AutoTokenizer, Qwen2VLProcessor

    class ImagesOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):  # type: ignore[no-untyped-def]
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)
            return None

    tok = AutoTokenizer.from_pretrained(folder)
    return ImagesOnlyProcessor(
        image_processor=image_processor(), tokenizer=tok, video_processor=_StandInVideoProcessor()
    )


@cache
def _float32_model(kind: str, folder: str):
    return hf_model_class(kind).from_pretrained(folder, dtype=torch.float32).eval()


def hf_qwen_vl_greedy(
    folder: Path, kind: str, text: str, images: list[Image.Image], max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, transformers' greedy tokens after it), float32, EOS ignored,
    for `text` with one <|vision_start|><|image_pad|><|vision_end|> per image."""
    inputs = reference_processor(folder)(images=images or None, text=[text], return_tensors="pt")
    model = _float32_model(kind, str(folder))
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    prompt_len = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, prompt_len:].tolist()
