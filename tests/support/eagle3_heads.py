"""Random EAGLE-3 heads written in the format vLLM loads, for a tiny random Llama target
(tests/support/models.py's width)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 4096  # the Llama-3.2 tokenizer's first ids
DRAFT_VOCAB = 512
HIDDEN = 64  # the target's (tests/support/models.py)
HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 2, 16, 96
AUX = [1, 2, 3]
SHARP = 0.2  # weights large enough that attention is far from uniform


def head_tensors(seed: int, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head's tensors under vLLM's names."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = SHARP) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    targets = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    return {
        "fc.weight": rand(hidden, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.mlp.gate_proj.weight": rand(FFN, hidden),
        "midlayer.mlp.up_proj.weight": rand(FFN, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, FFN),
        "norm.weight": 1 + rand(hidden, scale=0.1),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden),
        "d2t": targets - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def write_head(folder: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX},
        **config,
    }
    (folder / "config.json").write_text(json.dumps(settings))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
