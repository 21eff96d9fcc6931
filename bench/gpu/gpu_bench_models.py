"""The GPU benchmark's models: random weights in the shapes of Qwen3-0.6B and Llama-3.2-1B.

Each is built from its transformers config class with the published model's sizes and saved as
a Hugging Face folder (safetensors + the real model's tokenizer files), so that pagedserve and
transformers load the very same files. Random weights are enough for throughput: EOS is ignored
and every length is fixed. `tiny` keeps each architecture, RoPE and tokenizer but shrinks the
layers so that a CPU runs the whole benchmark in seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loading.model_spec import kv_bytes_per_block
from engine.models.registry import describe
from tests.support.models import tokenizer_dir


@dataclass(frozen=True)
class ModelSpec:
    label: str
    tokenizer: str  # a name of tests.support.models.TOKENIZERS
    # transformers' static-batch generate: the largest batch that safely fits an 80 GB GPU, set by
    # KV bytes per token (Qwen3 shape 112 KiB, Llama shape 32 KiB: 64 x 2048 tokens is 14 GiB for
    # the one, 128 x 2048 is 8 GiB for the other, with room for the padded prefill's activations).
    hf_batch_size: int
    tiny_hf_batch_size: int = 4


SPECS: dict[str, ModelSpec] = {
    "qwen3-0.6b": ModelSpec("Qwen3-0.6B shape", "qwen", hf_batch_size=64),
    "llama3.2-1b": ModelSpec("Llama-3.2-1B shape", "llama", hf_batch_size=128),
}

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def hf_config(name: str, vocab_size: int, tiny: bool):
    from transformers import LlamaConfig, Qwen3Config

    if name == "qwen3-0.6b":
        sizes = {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        }
        if tiny:
            sizes = {**TINY, "head_dim": 32}
        return Qwen3Config(
            **sizes,
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6,
        )
    if name == "llama3.2-1b":
        sizes = {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
        }
        if tiny:
            sizes = {**TINY, "head_dim": 16}
        return LlamaConfig(
            **sizes,
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            rms_norm_eps=1e-5,
        )
    raise ValueError(f"unknown model {name!r}; known: {', '.join(SPECS)}")


def build(name: str, folder: Path, device: str, dtype: torch.dtype, tiny: bool, seed: int) -> dict:
    """Save the model `name` with random weights into `folder`; the facts the benchmark needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(SPECS[name].tokenizer))
    cfg = hf_config(name, len(tok), tiny)
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    with torch.device(
        device
    ):  # initialized where it runs: a billion random numbers take seconds on a CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    parameters = model.num_parameters()  # the tied embedding counted once, as it is stored and read
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    return {
        "folder": str(folder),
        "parameters": parameters,
        "weight_bytes": parameters * dtype.itemsize,
        # K and V of every layer for one token
        "kv_bytes_per_token": kv_bytes_per_block(describe(cfg), 1, dtype),
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": len(tok),
        # Prompts draw from the base vocabulary less the special tokens: no added or control tokens.
        "prompt_vocab_size": tok.vocab_size,
        "special_ids": sorted(set(tok.all_special_ids)),
        "build_s": time.perf_counter() - start,
    }
