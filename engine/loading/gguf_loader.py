"""A GGUF file's weights into a loaded-shape model: quantized linear weights (the block types
of gguf_blocks, K-quants included) straight into the quantized kernel's layout, the fused
q/k/v and gate/up rows joined block by block (their types may differ, as in Q4_K_M files); the
rest (norms, and the embedding, which the lookup reads whole) as plain tensors through the
model's own loader. A tied head keeps the embedding's blocks; an untied one is a linear like the
others (often Q6_K in a K-quant file)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.loading.gguf_checkpoint import (
    QUANTIZED,
    dense,
    quantized,
    read_tensors,
    unpermute_dense,
    unpermute_rows,
)
from engine.loading.quantized_linears import keep_quantized_biases, place_quantized
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from kernels.cpu.quant_layout import QuantizedWeight, pack

log = logging.getLogger(__name__)


def load_gguf(model: DecoderModel, path: Path, hf_config: PretrainedConfig) -> dict[str, int]:
    """Fill `model` from `path`; the count of tensors read per GGUF type."""
    heads = {
        "self_attn.q_proj": int(hf_config.num_attention_heads),
        "self_attn.k_proj": int(hf_config.num_key_value_heads),
    }
    plain: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, dict[str | None, QuantizedWeight]] = {}
    head: QuantizedWeight | None = None
    counts: dict[str, int] = {}
    for tensor in read_tensors(path):
        counts[tensor.type] = counts.get(tensor.type, 0) + 1
        permute = next((h for key, h in heads.items() if f".{key}." in tensor.hf_name), None)
        if tensor.type not in QUANTIZED:
            value = dense(tensor)
            plain.append(
                (tensor.hf_name, value if permute is None else unpermute_dense(value, permute))
            )
            continue
        weight = quantized(tensor)
        if permute is not None:
            weight = unpermute_rows(weight, permute)
        if tensor.hf_name == "model.embed_tokens.weight":
            plain.append((tensor.hf_name, weight.dequantize()))  # the lookup reads rows whole
            if model.tie_word_embeddings:
                head = weight
            continue
        target = model._locate(tensor.hf_name)
        if target is None:
            continue
        name, part = target
        module_name, _, param = name.rpartition(".")
        module = model.get_submodule(module_name)
        if param != "weight" or not isinstance(module, PackableLinear):
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is {tensor.type}, which pagedserve reads only for "
                "linear weights"
            )
        parts.setdefault(module_name, {})[part] = weight
    place_quantized(model, parts, path)
    model.load_weights(plain)
    keep_quantized_biases(model)
    if head is not None:
        model.lm_head_quantized = pack(head)
    return counts
