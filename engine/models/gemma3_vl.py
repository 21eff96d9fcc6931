"""Gemma 3 with images: a SigLIP tower, average-pooled to `mm_tokens_per_image` soft tokens per
image, normed (Gemma's (1 + w) RMSNorm) and projected into our Gemma 3 text model, whose soft
tokens attend both ways within their image (engine/models/gemma3_image_attention.py).

Each `<start_of_image>` in a prompt becomes "\\n\\n", `<start_of_image>`, the soft tokens,
`<end_of_image>`, "\\n\\n", as Gemma3Processor expands it (pan-and-scan off). The soft tokens
take the projector's rows; their embeddings are not scaled by sqrt(hidden), as in transformers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma3_image_attention import ImagesBothWays
from engine.models.layers.attention import ForwardContext
from engine.models.layers.norm import RMSNorm
from engine.models.siglip_vision import SiglipVisionTower
from engine.models.vision_language import VisionLanguageFamily, VisionLanguageModel
from engine.multimodal.inputs import ImageItem
from engine.multimodal.processing import ImageProcessing
from kernels.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from PIL.Image import Image


class Gemma3Projector(nn.Module):
    """The tower's patch grid average-pooled to a square of soft tokens, normed, projected."""

    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        vision = cfg.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(cfg.mm_tokens_per_image**0.5)
        self.pool = self.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, gemma=True)
        # Stored [vision hidden, text hidden] (a matrix the features multiply, not a Linear).
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, cfg.text_config.hidden_size)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, soft tokens, text hidden]"""
        images, _, hidden = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(images, hidden, side, side)
        pooled = nn.functional.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3Vision(VisionLanguageModel):
    vision_modules = ("vision_tower", "multi_modal_projector")

    def build_vision(self, cfg: PretrainedConfig) -> None:
        self.vision_tower = SiglipVisionTower(cfg.vision_config)
        self.multi_modal_projector = Gemma3Projector(cfg)

    def vision_name(self, name: str) -> str:
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        weight = self.vision_tower.post_layernorm.weight
        pixels = item.data["pixel_values"].to(weight.device)
        return self.multi_modal_projector(self.vision_tower(pixels)).flatten(0, 1)

    def _begin(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, ForwardContext]:
        x, ctx = super()._begin(input_ids, positions, backend, kv_caches, meta)
        step = self.mm_step
        if step is not None and step.image_spans:
            # Only steps that compute an image need the both-ways rows.
            ctx = dataclasses.replace(ctx, backend=ImagesBothWays(backend, step.image_spans))
        return x, ctx

    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        return Gemma3Processing(cfg, path, tokenizer)


class Gemma3Processing:
    def __init__(self, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> None:
        from transformers import AutoImageProcessor

        # The PIL backend: the torchvision one needs a package this server does not install.
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.placeholder_id = int(cfg.boi_token_index)
        self.placeholder_text = str(tokenizer.convert_ids_to_tokens(self.placeholder_id))
        self.embed_id = int(cfg.image_token_index)
        # The image's soft tokens attend to each other both ways: computed in one chunk.
        self.whole_spans = True
        # The processor writes "\n\n" around an image as text, tokenized with its neighbours:
        # `join_edges` merges them with whitespace beside the placeholder as that does.
        self.tokenizer = tokenizer
        newlines = list(tokenizer.encode("\n\n", add_special_tokens=False))
        self.num_newline_tokens = len(newlines)
        soft = [self.embed_id] * int(cfg.mm_tokens_per_image)
        self.span_tokens = [
            *newlines,
            self.placeholder_id,
            *soft,
            int(cfg.eoi_token_index),
            *newlines,
        ]

    def preprocess(self, image: Image) -> dict[str, torch.Tensor]:
        # Pan-and-scan (extra crops, each its own span) is off, as in Gemma 3's published
        # processor settings.
        out = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}

    def span(self, data: dict[str, torch.Tensor]) -> list[int]:
        return list(self.span_tokens)

    def join_edges(
        self, before: list[int], span: list[int], after: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """The span's "\n\n" on each side tokenized together with a whitespace token beside
        it ("user\n" then "\n\n": one "\n\n\n"), as the processor's text tokenizes; the
        merged tokens belong to the span."""
        n = self.num_newline_tokens
        if before and self._blank(before[-1]):
            span = self._encode(self._text(before[-1]) + "\n\n") + span[n:]
            before = before[:-1]
        if after and self._blank(after[0]):
            span = span[:-n] + self._encode("\n\n" + self._text(after[0]))
            after = after[1:]
        return before, span, after

    def _text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _blank(self, token: int) -> bool:
        text = self._text(token)
        return bool(text) and not text.strip() and token not in self.tokenizer.all_special_ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def rope_positions(self, token_ids: list[int], items: Any) -> None:
        return None


Gemma3ForConditionalGeneration = VisionLanguageFamily(Gemma3Vision, Gemma3ForCausalLM)
