"""PEFT LoRA adapters made in tests on a saved model, and transformers + peft as their oracle."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import greedy_of

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path,
    folder: Path,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    use_rslora: bool = False,
    std: float = 0.1,
) -> Path:
    """A PEFT adapter for the model in `model_dir`, with random non-zero A and B (PEFT starts B
    at zero, which would make the adapter the identity), saved with `save_pretrained`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(folder)
    return folder


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens with the adapter applied by peft (None: the base model),
    one prompt at a time, float32, EOS ignored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_of(model, prompts, max_new_tokens)
