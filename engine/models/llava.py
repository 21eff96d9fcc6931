"""LLaVA: a CLIP vision tower, a two-layer projector into the text model's width, and any
text model of ours. Each `<image>` in a prompt becomes one token per image patch (plus the
class token under the "full" feature strategy), as LlavaProcessor expands it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from engine.models.clip_vision import ClipVisionTower
from engine.models.vision_language import VisionLanguageFamily, VisionLanguageModel
from engine.multimodal.inputs import ImageItem
from engine.multimodal.processing import ImageProcessing

if TYPE_CHECKING:
    from PIL.Image import Image


class LlavaProjector(nn.Module):
    def __init__(self, cfg: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "multimodal_projector_bias", True))
        vision, text = cfg.vision_config.hidden_size, cfg.text_config.hidden_size
        self.linear_1 = nn.Linear(vision * num_layers, text, bias=bias)
        self.act = ACT2FN[cfg.projector_hidden_act]
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _feature_layers(cfg: PretrainedConfig) -> list[int]:
    layer = cfg.vision_feature_layer
    return list(layer) if isinstance(layer, (list, tuple)) else [layer]


class LlavaVision(VisionLanguageModel):
    vision_modules = ("vision_tower", "multi_modal_projector")

    def build_vision(self, cfg: PretrainedConfig) -> None:
        self.vision_tower = ClipVisionTower(cfg.vision_config)
        self.multi_modal_projector = LlavaProjector(cfg, len(_feature_layers(cfg)))
        self.keep_class_token = cfg.vision_feature_select_strategy == "full"

    def vision_name(self, name: str) -> str:
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        pixels = item.data["pixel_values"].to(self.vision_tower.pre_layrnorm.weight.device)
        states = self.vision_tower.hidden_states(pixels, _feature_layers(self.vlm_config))
        features = torch.cat(states, dim=-1)
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features).flatten(0, 1)

    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        return LlavaProcessing(cfg, path, tokenizer)


class LlavaProcessing:
    def __init__(self, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        # The PIL backend: the torchvision one needs a package this server does not install.
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.placeholder_id = self.embed_id = int(cfg.image_token_index)
        self.placeholder_text = str(tokenizer.convert_ids_to_tokens(self.placeholder_id))
        self.patch_size = int(cfg.vision_config.patch_size)
        self.class_token = cfg.vision_feature_select_strategy == "full"
        self.whole_spans = False  # causal attention over image tokens, as over text

    def preprocess(self, image: Image) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}

    def span(self, data: dict[str, torch.Tensor]) -> list[int]:
        height, width = data["pixel_values"].shape[-2:]
        patches = (height // self.patch_size) * (width // self.patch_size)
        return [self.embed_id] * (patches + int(self.class_token))

    def rope_positions(self, token_ids: list[int], items: Any) -> None:
        return None


LlavaForConditionalGeneration = VisionLanguageFamily(LlavaVision)
