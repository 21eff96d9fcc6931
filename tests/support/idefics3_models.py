"""Tiny random-weight Idefics3 (SmolVLM's architecture) models, saved as Hugging Face folders
with the Llama-3.2 tokenizer plus Idefics3's special tokens and the real Idefics3Processor
(PIL image processor), so that transformers' own processor and model are the oracle.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import tokenizer_dir

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
) -> Path:
    """A tiny Idefics3: a two-layer SigLIP-shaped tower over `tile_px`-pixel tiles of 8-pixel
    patches (16 patches, 4 image tokens per tile after a 2x pixel shuffle), the connector's
    one linear, and a two-layer Llama text model. Images are resized to a `longest_edge` of 64
    pixels, so that with `splitting` they become 2x2 (or 1x2, 2x1) tiles plus the global one."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama"))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    patch = 8
    cfg = Idefics3Config(
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
            "tie_word_embeddings": False,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.eos_token_id,
        },
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        tie_word_embeddings=False,
    )
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():  # norms and biases start at 1 and 0: randomize them so loading shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    image_seq_len = (tile_px // patch) ** 2 // scale_factor**2
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": longest_edge},
            max_image_size={"longest_edge": tile_px},
            do_image_splitting=splitting,
        ),
        tokenizer=tok,
        image_seq_len=image_seq_len,
        chat_template=_TEMPLATE,
    )
    processor.save_pretrained(folder)
    tok.chat_template = _TEMPLATE
    tok.save_pretrained(folder)
    return folder
