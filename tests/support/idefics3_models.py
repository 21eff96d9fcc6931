"""Tiny random-weight Idefics3 and SmolVLM models, saved as Hugging Face folders with the
Llama-3.2 tokenizer plus Idefics3's special tokens and the real processor files (PIL image
processor), so that transformers' own processor and model are the oracle.

SmolVLMProcessor needs a video processor (torchvision) and num2words, neither installed here:
a SmolVLM folder holds its image processor alone, and `hf_greedy_on_ids` runs transformers'
model on token ids laid out elsewhere (its span layout is Idefics3Processor's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tests.support.models import tokenizer_dir

if TYPE_CHECKING:
    from PIL import Image

# Each image part becomes the one `<image>` the processor expands; turns end with
# `<end_of_utterance>` as SmolVLM's published template ends them.
_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>:"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>:{% endif %}"
)

# The tokens SmolVLM's tokenizer has for its image spans: tile markers, the global image's
# tag, and the tile grid positions up to 6x6.
SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]


def build_idefics3(
    folder: Path,
    seed: int = 0,
    tile_px: int = 32,
    longest_edge: int = 64,
    splitting: bool = True,
    scale_factor: int = 2,
    kind: str = "idefics3",
    tie: tuple[bool, bool] = (False, False),
) -> Path:
    """A tiny Idefics3: a two-layer SigLIP-shaped tower over `tile_px`-pixel tiles of 8-pixel
    patches (16 patches, 4 image tokens per tile after a 2x pixel shuffle), the connector's
    one linear, and a two-layer Llama text model. Images are resized to a `longest_edge` of 64
    pixels, so that with `splitting` they become 2x2 (or 1x2, 2x1) tiles plus the global one.
    `kind`: "idefics3" or "smolvlm" (SmolVLM2's classes); `tie`: the config's
    `tie_word_embeddings`, then its text config's."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm import SmolVLMImageProcessorPil

    config_class, model_class, image_processor_class = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil),
    }[kind]

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    patch = 8
    cfg = config_class(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": tile_px,
            "patch_size": patch,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": tie[1],
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.eos_token_id,
        },
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        tie_word_embeddings=tie[0],
    )
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():  # norms and biases start at 1 and 0: randomize them so loading shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    image_processor = image_processor_class(
        size={"longest_edge": longest_edge},
        max_image_size={"longest_edge": tile_px},
        do_image_splitting=splitting,
    )
    if kind == "idefics3":
        image_seq_len = (tile_px // patch) ** 2 // scale_factor**2
        Idefics3Processor(
            image_processor=image_processor,
            tokenizer=tok,
            image_seq_len=image_seq_len,
            chat_template=_TEMPLATE,
        ).save_pretrained(folder)
    else:
        image_processor.save_pretrained(folder)
    tok.chat_template = _TEMPLATE
    tok.save_pretrained(folder)
    return folder


def hf_greedy_on_ids(
    folder: Path, input_ids: list[int], images: list[Image.Image], max_new_tokens: int
) -> list[int]:
    """transformers' greedy tokens (float32) for a prompt already expanded into `input_ids`,
    with the pixels of the image processor saved in `folder`."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    pixels = AutoImageProcessor.from_pretrained(folder, backend="pil")(
        images=[images], return_tensors="pt"
    )
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([input_ids]),
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.int64),
            pixel_values=pixels["pixel_values"],
            pixel_attention_mask=pixels["pixel_attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(input_ids) :].tolist()
