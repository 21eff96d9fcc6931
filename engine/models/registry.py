"""Architecture name (a config's `architectures`) -> the module and class that implement it.
Modules are imported when a model of theirs is loaded, not before. Adding an architecture is
one file in this folder and one row here."""

from __future__ import annotations

import importlib
from typing import Any, cast

from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.models.interface import ArchitectureInfo, ModelClass

# architecture -> (module under engine.models, class, the config's model_type)
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM", "qwen3"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", "gemma2"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM", "phi3"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM", "mixtral"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "BertModel": ("bert", "BertModel", "bert"),
    # Vision-language: images in the prompt (engine/multimodal).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration", "llava"),
    "Gemma3ForConditionalGeneration": ("gemma3_vl", "Gemma3ForConditionalGeneration", "gemma3"),
    "Idefics3ForConditionalGeneration": (
        "idefics3",
        "Idefics3ForConditionalGeneration",
        "idefics3",
    ),
    "SmolVLMForConditionalGeneration": ("idefics3", "SmolVLMForConditionalGeneration", "smolvlm"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": (
        "qwen2_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "qwen2_5_vl",
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def resolve_architecture(hf_config: PretrainedConfig) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:  # a config built from its class in code names no architecture
        model_type = getattr(hf_config, "model_type", None)
        names = [a for a, (_, _, t) in ARCHITECTURES.items() if t == model_type]
    for name in names:
        if name in ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type {getattr(hf_config, 'model_type', None)!r}"
    raise ModelLoadError(
        f"unsupported model architecture {found}; supported: {', '.join(ARCHITECTURES)}"
    )


def describe(hf_config: PretrainedConfig) -> ArchitectureInfo:
    """What the engine needs to know of the model before building it."""
    return model_class(resolve_architecture(hf_config)).describe(hf_config)


def image_processing_of(architecture: str) -> Any:
    """The architecture's `processing(cfg, path, tokenizer)` factory, or None for a model that
    reads no images."""
    return getattr(model_class(architecture), "processing", None)


def model_class(architecture: str) -> ModelClass:
    module, name, _ = ARCHITECTURES[architecture]
    return cast(ModelClass, getattr(importlib.import_module(f"engine.models.{module}"), name))
