"""A GGUF file's weights into a loaded-shape model: quantized linear weights (the block types
of gguf_blocks, K-quants included) straight into the quantized kernel's layout, the fused
q/k/v and gate/up rows joined block by block (their types may differ, as in Q4_K_M files); the
rest (norms, and the embedding, which the lookup reads whole) as plain tensors through the
model's own loader. A tied head keeps the embedding's blocks; an untied one is a linear like the
others (often Q6_K in a K-quant file)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import PretrainedConfig

from engine.errors import ModelLoadError
from engine.loading.gguf_checkpoint import (
    QUANTIZED,
    GGUFTensor,
    dense,
    quantized,
    read_tensors,
    unpermute_dense,
    unpermute_rows,
)
from engine.loading.quantized_linears import QuantizedPlacer, keep_quantized_biases
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from kernels.cpu.quant_layout import QuantizedWeight, pack

log = logging.getLogger(__name__)


def load_gguf(
    model: DecoderModel, path: Path, hf_config: PretrainedConfig, device: torch.device
) -> dict[str, int]:
    """Fill `model`, built on the meta device, from `path`; the count of tensors read per GGUF
    type. The quantized linears are packed first, each module as soon as its parts are read,
    while the model is on meta, so that their float weights are never allocated; then the
    parameters that stay dense are allocated on `device` and read from the (memory-mapped)
    file one tensor at a time (the embedding is de-quantized in float32 only while it is
    copied)."""
    heads = {
        "self_attn.q_proj": int(hf_config.num_attention_heads),
        "self_attn.k_proj": int(hf_config.num_key_value_heads),
    }
    placer = QuantizedPlacer(model, path)
    later: list[GGUFTensor] = []  # views of the mapped file: nothing read yet
    decoded: dict[str, QuantizedWeight] = {}  # a tied embedding's blocks, decoded once for both
    counts: dict[str, int] = {}
    for tensor in read_tensors(path):
        counts[tensor.type] = counts.get(tensor.type, 0) + 1
        if tensor.type not in QUANTIZED:
            later.append(tensor)
            continue
        if tensor.hf_name == "model.embed_tokens.weight":
            later.append(tensor)
            if model.tie_word_embeddings:  # the head keeps the embedding's blocks
                decoded[tensor.name] = quantized(tensor)
                model.lm_head_quantized = pack(decoded[tensor.name])
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
        weight = quantized(tensor)
        permute = _permuted_heads(tensor.hf_name, heads)
        placer.add(
            module_name, part, weight if permute is None else unpermute_rows(weight, permute)
        )
    placer.finish()
    model.to_empty(device=device)  # only what stays dense: the packed layers have no weight
    model.load_weights(_plain(later, heads, decoded))
    keep_quantized_biases(model)
    return counts


def _permuted_heads(hf_name: str, heads: dict[str, int]) -> int | None:
    """The heads of a q or k weight (whose rows llama.cpp's converter permuted), else None."""
    return next((h for key, h in heads.items() if f".{key}." in hf_name), None)


def _plain(
    tensors: list[GGUFTensor], heads: dict[str, int], decoded: dict[str, QuantizedWeight]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that stay dense (norms, the embedding de-quantized: the lookup reads rows
    whole), read one at a time; `decoded`: blocks already decoded, by tensor name."""
    for tensor in tensors:
        if tensor.type in QUANTIZED:
            weight = decoded.pop(tensor.name, None)
            if weight is None:
                weight = quantized(tensor)
            yield tensor.hf_name, weight.dequantize()
            continue
        value = dense(tensor)
        permute = _permuted_heads(tensor.hf_name, heads)
        yield tensor.hf_name, value if permute is None else unpermute_dense(value, permute)
