"""Qwen2-VL and Qwen2.5-VL: a vision tower of ours (engine/models/qwen2_vl_vision.py) whose
merged patch embeddings take the place of the prompt's `<|image_pad|>` tokens, over a Qwen2
text model that rotates by M-RoPE positions (engine/models/mrope.py).

A chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for each image; the image
processor picks each image's patch grid from its size, and the one `<|image_pad|>` becomes one
per merged 2x2 patch block, as Qwen2VLProcessor expands it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PretrainedConfig

from engine.distributed.shard import WHOLE, Shard
from engine.models.interface import text_config
from engine.models.layers.rotary import rope_parameters
from engine.models.llama import LlamaForCausalLM
from engine.models.mrope import ImageSpan, mrope_positions
from engine.models.qwen2_vl_vision import Qwen2VisionTower, Qwen25VisionTower, locate_in_tower
from engine.models.vision_language import VisionLanguageFamily, VisionLanguageModel
from engine.multimodal.inputs import ImageItem

if TYPE_CHECKING:
    from PIL.Image import Image

# The text model's tensors in the layout Qwen2-VL's checkpoints use (and transformers 5 saves):
# `model.layers...` beside `visual...`, rather than under `model.language_model.`.
_OLD_TEXT_PREFIX = "model."
_NEW_TEXT_PREFIX = "model.language_model."


class Qwen2VLVision(VisionLanguageModel):
    vision_modules = ("visual",)
    tower_class: ClassVar[type[Qwen2VisionTower]] = Qwen2VisionTower

    def __init__(self, cfg: PretrainedConfig, shard: Shard = WHOLE) -> None:
        super().__init__(cfg, shard)
        section = rope_parameters(text_config(cfg)).get("mrope_section")
        self.mrope_section = tuple(section) if section else None

    def build_vision(self, cfg: PretrainedConfig) -> None:
        self.visual = self.tower_class(cfg.vision_config)

    def vision_name(self, name: str) -> str:
        return "visual." + locate_in_tower(name.removeprefix("visual."))[0]

    def _locate(self, hf_name: str) -> tuple[str, str | None] | None:
        text = hf_name.startswith(_OLD_TEXT_PREFIX) and not hf_name.startswith(
            (_NEW_TEXT_PREFIX, "model.visual.")
        )
        if text:
            hf_name = _NEW_TEXT_PREFIX + hf_name.removeprefix(_OLD_TEXT_PREFIX)
        return super()._locate(hf_name)

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        device = self.visual.patch_embed.weight.device
        pixels = item.data["pixel_values"].to(device)
        return self.visual(pixels, item.data["image_grid_thw"])

    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> Qwen2VLProcessing:
        return Qwen2VLProcessing(cfg, path, tokenizer)


class Qwen25VLVision(Qwen2VLVision):
    tower_class = Qwen25VisionTower


class Qwen2VLProcessing:
    """Images into `<|image_pad|>` spans and M-RoPE positions; the model's image processor
    (its PIL backend: the torchvision one needs a package this server does not install)."""

    def __init__(self, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.placeholder_id = self.embed_id = int(cfg.image_token_id)
        self.placeholder_text = str(tokenizer.convert_ids_to_tokens(self.placeholder_id))
        self.merge_size = int(self.image_processor.merge_size)
        self.whole_spans = False  # causal attention over image tokens, as over text

    def preprocess(self, image: Image) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def num_tokens(self, grid_thw: torch.Tensor) -> int:
        return int(grid_thw.prod()) // self.merge_size**2

    def span(self, data: dict[str, torch.Tensor]) -> list[int]:
        return [self.embed_id] * self.num_tokens(data["image_grid_thw"])

    def rope_positions(
        self, token_ids: list[int], items: Sequence[ImageItem]
    ) -> tuple[torch.Tensor, int] | None:
        if not items:  # text alone: a token's three positions are its index
            return None
        spans = []
        for item in items:
            t, h, w = item.data["image_grid_thw"][0].tolist()
            spans.append(ImageSpan(item.offset, (t, h, w)))
        return mrope_positions(len(token_ids), spans, self.merge_size)


Qwen2VLForConditionalGeneration = VisionLanguageFamily(Qwen2VLVision, LlamaForCausalLM)
Qwen2_5_VLForConditionalGeneration = VisionLanguageFamily(Qwen25VLVision, LlamaForCausalLM)
