"""Writes a random-weight Llama of 124.7M parameters (hidden 768, 12 layers, 12 query / 4 KV heads
of 64, MLP 2048, vocabulary 32,000, untied head) with the default model's tokenizer into a
folder, for benchmarks of a model shaped unlike the default one (fewer, wider layers).

    python bench/models/random_llama.py [FOLDER]     # default ~/.cache/pagedserve/random-llama-124m
    python bench/serving/compare_vllm.py --model-dir FOLDER --vocab-size 32000 --dtype bfloat16

The tokenizer's ids past 32,000 are never sent (`--vocab-size 32000`) nor produced.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

DEFAULT_FOLDER = Path.home() / ".cache" / "pagedserve" / "random-llama-124m"
TOKENIZER_FOLDER = Path.home() / ".cache" / "pagedserve" / "SmolLM2-135M-Instruct"


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER
    config = LlamaConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_FOLDER)
    config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"{params / 1e6:.1f}M parameters -> {folder}")


if __name__ == "__main__":
    main()
