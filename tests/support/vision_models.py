"""Random-weight vision-language models of real architectures, saved as Hugging Face folders
with their real processors, and the images the tests send them.

transformers itself is the oracle: `hf_vlm_greedy` runs its `generate` on the processor's
own inputs for a prompt with images.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.support.models import tokenizer_dir

# A chat template that puts each image part where it stands among the text parts, as LLaVA's
# published templates do (the model's own token for one image).
_LLAVA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def sample_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    """A random RGB image (width, height): each seed its own pixels."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def build_llava(
    folder: Path,
    seed: int = 0,
    strategy: str = "default",
    vision: dict | None = None,
    text: dict | None = None,
    image_px: int = 28,
) -> Path:
    """A tiny LLaVA: a CLIP tower (28x28 images, 14-pixel patches: 4 image tokens, 5 with
    the class token under the "full" strategy), a two-layer projector, a Llama text model with
    the Llama-3.2 tokenizer plus its `<image>` token, and LlavaProcessor's files. `vision`,
    `text`: config values that replace the tiny ones; `image_px`: the processor's image side
    (the tower's `image_size`)."""
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama"))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision_config = CLIPVisionConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "image_size": image_px,
            "patch_size": 14,
            "projection_dim": 32,
            **(vision or {}),
        }
    )
    text_config = LlamaConfig(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            "eos_token_id": tok.eos_token_id,
            **(text or {}),
        }
    )
    cfg = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
    )
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # norms and biases start at 1 and 0: randomize them so loading shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_px}, crop_size={"height": image_px, "width": image_px}
        ),
        tokenizer=tok,
        patch_size=vision_config.patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
        chat_template=_LLAVA_TEMPLATE,
    )
    processor.save_pretrained(folder)
    tok.chat_template = _LLAVA_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def hf_vlm_greedy(
    folder: Path, text: str, images: list[Image.Image], max_new_tokens: int, device: str = "cpu"
) -> list[int]:
    """transformers' greedy tokens (float32) for `text` (with the model's image tokens) and
    `images`, through the processor saved in `folder`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    inputs = processor(images=images or None, text=[text], return_tensors="pt").to(device)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    model = model.to(device).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
