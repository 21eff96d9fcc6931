"""Idefics3 and SmolVLM (the same architecture under two names): an image is cut into tiles plus one
downscaled global view; each tile goes through the vision transformer and the connector (pixel
shuffle, one linear) to `image_seq_len` rows, and any text model of ours reads them.

The prompt's one `<image>` becomes, as Idefics3Processor expands it, per tile
`<fake_token_around_image><row_i_col_j>` and `<image>` x image_seq_len (a newline after each
row of tiles), then `<fake_token_around_image><global-img>`, the global view's `<image>`s and a
closing `<fake_token_around_image>`: only the `<image>` positions take encoder rows.
SmolVLMProcessor lays spans out alike, with the marker tokens its tokenizer names."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig

from engine.models.idefics3_vision import Idefics3Connector, Idefics3VisionTransformer
from engine.models.vision_language import VisionLanguageFamily, VisionLanguageModel
from engine.multimodal.inputs import ImageItem
from engine.multimodal.processing import ImageProcessing

if TYPE_CHECKING:
    from PIL.Image import Image

_TEXT_PREFIX = "model.text_model."  # where Idefics3 checkpoints keep the text model
# What opens and closes each tile, and what tags the global view (Idefics3Processor's).
_MARKER, _GLOBAL = "<fake_token_around_image>", "<global-img>"


class Idefics3Vision(VisionLanguageModel):
    vision_modules = ("vision_model", "connector")

    def build_vision(self, cfg: PretrainedConfig) -> None:
        self.vision_model = Idefics3VisionTransformer(cfg.vision_config)
        self.connector = Idefics3Connector(cfg)

    def _locate(self, hf_name: str) -> tuple[str, str | None] | None:
        if hf_name.startswith(_TEXT_PREFIX):
            hf_name = "model.language_model." + hf_name.removeprefix(_TEXT_PREFIX)
        return super()._locate(hf_name)

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        """Rows of every tile in the processor's order (row by row, then the global view)."""
        pixels = item.data["pixel_values"].to(self.connector.modality_projection.proj.weight)
        return self.connector(self.vision_model(pixels)).flatten(0, 1)

    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        return Idefics3Processing(cfg, path, tokenizer)


class SmolVLMVision(Idefics3Vision):
    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        # SmolVLMProcessor takes the markers from the tokenizer (these are its defaults).
        markers = (
            getattr(tokenizer, "fake_image_token", None) or _MARKER,
            getattr(tokenizer, "global_image_token", None) or _GLOBAL,
        )
        return Idefics3Processing(cfg, path, tokenizer, markers)


class Idefics3Processing:
    def __init__(
        self,
        cfg: PretrainedConfig,
        path: Path,
        tokenizer: Any,
        markers: tuple[str, str] = (_MARKER, _GLOBAL),
    ) -> None:
        from transformers import AutoImageProcessor

        # The PIL backend: the torchvision one needs a package this server does not install.
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.tokenizer = tokenizer
        self.marker, self.global_tag = markers
        self.placeholder_id = self.embed_id = int(cfg.image_token_id)
        self.placeholder_text = str(tokenizer.convert_ids_to_tokens(self.placeholder_id))
        vision = cfg.vision_config
        # As the model counts it: a tile's patches after the pixel shuffle.
        per_side = vision.image_size // vision.patch_size
        self.image_seq_len = per_side**2 // cfg.scale_factor**2
        self.whole_spans = False  # causal attention over image tokens, as over text
        self._spans: dict[tuple[int, int], list[int]] = {}

    def preprocess(self, image: Image) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt", return_row_col_info=True)
        # One image: its tiles are all real (padding tiles only fill out a batch of images).
        return {
            "pixel_values": out["pixel_values"][0],
            "grid": torch.tensor([out["rows"][0][0], out["cols"][0][0]]),
        }

    def span(self, data: dict[str, torch.Tensor]) -> list[int]:
        rows, cols = (int(n) for n in data["grid"])
        if (rows, cols) not in self._spans:
            # Tokenized as text: the newlines between tiles are ordinary tokens ("\n\n" one
            # token or two, as the tokenizer merges them), and the span's ends are special
            # tokens, so nothing in it merges with the prompt around it.
            text = self._span_text(rows, cols)
            self._spans[rows, cols] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._spans[rows, cols]

    def _span_text(self, rows: int, cols: int) -> str:
        images = self.placeholder_text * self.image_seq_len
        whole = f"{self.marker}{self.global_tag}{images}{self.marker}"
        if rows == 0 and cols == 0:  # not split: the global view alone
            return whole
        grid = "".join(
            "".join(f"{self.marker}<row_{r + 1}_col_{c + 1}>{images}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{whole}"

    def rope_positions(self, token_ids: list[int], items: Any) -> None:
        return None


Idefics3ForConditionalGeneration = VisionLanguageFamily(Idefics3Vision)
SmolVLMForConditionalGeneration = VisionLanguageFamily(SmolVLMVision)
