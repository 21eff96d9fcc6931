"""How far a decode step is from this machine's memory bandwidth: a decode step reads every weight
it multiplies by (the embedding table only where it is also the LM head) and every running
sequence's KV cache; at the bandwidth a torch tensor copy reaches, that takes `floor` seconds.

    bandwidth = (bytes read + bytes written) / s of a 1 GiB tensor copy in torch
    floor     = (weight bytes + KV bytes of `sequences` sequences of `context` tokens) / bandwidth
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def copy_bandwidth(nbytes: int = 2**30, copies: int = 10) -> float:
    """Bytes read + written per second of a `nbytes` tensor copy, with torch's threads."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src)
    return 2 * nbytes * copies / (time.perf_counter() - start)


@dataclass(frozen=True)
class DecodeBytes:
    weights: int  # read once a step
    kv_per_token: int  # K and V of every layer for one token

    def floor_s(self, sequences: int, context: float, bandwidth: float) -> float:
        return (self.weights + sequences * context * self.kv_per_token) / bandwidth


def decode_bytes(model_dir: Path, dtype: str) -> DecodeBytes:
    """From the checkpoint's tensor shapes (safetensors headers) and config."""
    cfg = json.loads((model_dir / "config.json").read_text())
    size = DTYPE_BYTES[dtype]
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith("embed_tokens.weight") and not tied:
                    continue  # a lookup of a few rows; the separate LM head is what is read
                shape = f.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                params += count
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    kv = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size
    return DecodeBytes(params * size, kv)
