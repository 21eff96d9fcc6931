"""Which Hugging Face architectures the Llama-family implementation serves."""

from __future__ import annotations

from transformers import PretrainedConfig

from engine.errors import ModelLoadError

# architecture name -> model_type; all run on engine.models.llama.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def resolve_architecture(hf_config: PretrainedConfig) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:  # a config built from its class in code names no architecture
        names = [
            a
            for a, t in SUPPORTED_ARCHITECTURES.items()
            if t == getattr(hf_config, "model_type", None)
        ]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type {getattr(hf_config, 'model_type', None)!r}"
    raise ModelLoadError(
        f"unsupported model architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
