"""A tiny random-weight Gemma 3 vision-language model, saved as a Hugging Face folder with
transformers' own Gemma3Processor (its PIL image processor).

No Gemma tokenizer is at hand offline: the Llama-3.2 tokenizer takes Gemma's three image tokens
as special tokens, under the names Gemma3Processor reads (`boi_token`, `eoi_token`,
`image_token`), so the processor runs unchanged on it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import tokenizer_dir

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

# Gemma 3's template cut to what the tests send: each image part is `<start_of_image>`.
_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_gemma3(
    folder: Path,
    seed: int = 0,
    image_px: int = 28,
    tokens_per_image: int = 4,
    vision: dict | None = None,
    text: dict | None = None,
) -> Path:
    """A tiny Gemma 3: a two-layer SigLIP tower over 28x28 images in 7-pixel patches (4x4),
    average-pooled to `tokens_per_image` (2x2) soft tokens; a Gemma 3 text model with a
    sliding (window 6) and a global layer; Gemma3Processor's files. `vision`, `text`: config
    values that replace the tiny ones."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(
        tokenizer_dir("llama"),
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT},
    )
    vision_config = SiglipVisionConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": image_px,
            "patch_size": 7,
            "vision_use_head": False,
            **(vision or {}),
        }
    )
    text_config = Gemma3TextConfig(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "max_position_embeddings": 1024,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "eos_token_id": tok.eos_token_id,
            **(text or {}),
        }
    )
    cfg = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
    )
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # norms, biases and the projection start at 0: randomize them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "mm_input_projection" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": image_px, "width": image_px}),
        tokenizer=tok,
        image_seq_length=tokens_per_image,
        chat_template=_TEMPLATE,
    )
    processor.save_pretrained(folder)
    tok.chat_template = _TEMPLATE
    tok.save_pretrained(folder)
    return folder
