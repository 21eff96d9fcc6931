"""What every vision-language model here shares: a decoder of ours for its `text_config`
(any text architecture in the registry), plus vision modules of its own whose outputs take the
place of the prompt's image tokens (DecoderModel's `mm_step`).

An architecture file defines its vision part as a `VisionLanguageModel` subclass and exports a
`VisionLanguageFamily` of it: the class actually built is composed with the text model's class
when a config names it, so LLaVA over Llama, Mistral or Qwen2 is one file.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig

from engine.distributed.shard import WHOLE, Shard
from engine.models.base import DecoderModel
from engine.models.interface import ArchitectureInfo, text_config
from engine.models.registry import model_class, resolve_architecture
from engine.multimodal.inputs import ImageItem
from engine.multimodal.processing import ImageProcessing

# Where checkpoints put the text model: transformers 5's layout, then the older one.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


class VisionLanguageModel(DecoderModel):
    # The checkpoint's vision modules (after `model.`), each ours under the same name.
    vision_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: PretrainedConfig, shard: Shard = WHOLE) -> None:
        # transformers ties the head to the embeddings by the top-level flag, whatever the
        # text config says (a tied checkpoint holds no lm_head, an untied one its own).
        text = copy.copy(text_config(cfg))
        text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        super().__init__(text, shard)
        self.vlm_config = cfg
        self.build_vision(cfg)

    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        return super().describe(text_config(cfg))

    # ------------------------------------------------------------ what a subclass provides

    def build_vision(self, cfg: PretrainedConfig) -> None:
        raise NotImplementedError

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        """One image's embeddings for its span's image tokens, [num_embeds, text hidden]."""
        raise NotImplementedError

    @classmethod
    def processing(cls, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        raise NotImplementedError

    def vision_name(self, name: str) -> str:
        """Our parameter for a vision tensor's checkpoint name (after `model.`)."""
        return name

    # ------------------------------------------------------------------ shared behaviour

    def _locate(self, hf_name: str) -> tuple[str, str | None] | None:
        for prefix in _TEXT_PREFIXES:
            if hf_name.startswith(prefix):
                return super()._locate("model." + hf_name.removeprefix(prefix))
        if hf_name in _HEAD_NAMES:
            return super()._locate("lm_head.weight")
        name = hf_name.removeprefix("model.")
        if name.split(".", 1)[0] in self.vision_modules:
            return self.vision_name(name), None
        return None


class VisionLanguageFamily:
    """A `ModelClass`: the vision part over whichever text model the config names."""

    def __init__(
        self,
        vision: type[VisionLanguageModel],
        text: type[DecoderModel] | None = None,
    ) -> None:
        self.vision = vision
        self.text = text  # None: the registry's class for the config's text model

    def compose(self, cfg: PretrainedConfig) -> type[VisionLanguageModel]:
        text = self.text
        if text is None:
            text = model_class(resolve_architecture(text_config(cfg)))  # type: ignore[assignment]
        return _composed(self.vision, text)  # type: ignore[arg-type]

    def __call__(self, cfg: PretrainedConfig, shard: Shard) -> VisionLanguageModel:
        return self.compose(cfg)(cfg, shard)

    def describe(self, cfg: PretrainedConfig) -> ArchitectureInfo:
        return self.compose(cfg).describe(cfg)

    def processing(self, cfg: PretrainedConfig, path: Path, tokenizer: Any) -> ImageProcessing:
        return self.vision.processing(cfg, path, tokenizer)


@cache
def _composed(
    vision: type[VisionLanguageModel], text: type[DecoderModel]
) -> type[VisionLanguageModel]:
    return type(f"{vision.__name__}Over{text.__name__}", (vision, text), {})
