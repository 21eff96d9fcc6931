"""A GGUF file's weights into a loaded-shape model: quantized linear weights (the block types
of gguf_blocks, K-quants included) straight into the quantized kernel's layout, the fused
q/k/v and gate/up rows joined block by block (their types may differ, as in Q4_K_M files); the
rest (norms, and the embedding, which the lookup reads whole) as plain tensors through the
model's own loader. A tied head keeps the embedding's blocks; an untied one is a linear like the
others (often Q6_K in a K-quant file)."""

from __future__ import annotations

import logging
import math
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
from engine.models.base import DecoderModel
from engine.models.layers.linear import ColumnParallelLinear, PackableLinear
from kernels.cpu.quant_layout import QuantizedWeight, pack

log = logging.getLogger(__name__)


def join_rows(parts: list[QuantizedWeight], what: str) -> QuantizedWeight:
    """Weights stacked by output rows (q, k, v into qkv). Parts of different block types meet
    on common terms, each exactly: mixed 8- and 4-bit parts become 8-bit (a 4-bit value fits),
    zero mins where a part has none, and different group sizes the largest size that divides
    them all (a group of 32 is two groups of 16 with its scale and min repeated)."""
    columns = {int(p.q.shape[1]) for p in parts}
    if len(columns) != 1:
        raise ModelLoadError(f"{what}: its parts have {sorted(columns)} input features")
    group = math.gcd(*(p.group for p in parts))  # even, as every part's group is
    bits = parts[0].bits if len({p.bits for p in parts}) == 1 else 8
    with_mins = any(p.mins is not None for p in parts)

    def split(values: torch.Tensor, part: QuantizedWeight) -> torch.Tensor:
        return values.repeat_interleave(part.group // group, dim=1)

    mins = None
    if with_mins:
        mins = torch.cat(
            [split(torch.zeros_like(p.scales) if p.mins is None else p.mins, p) for p in parts]
        )
    return QuantizedWeight(
        torch.cat([p.q for p in parts]), torch.cat([split(p.scales, p) for p in parts]), mins, bits
    )


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
    for module_name, found in parts.items():
        module = model.get_submodule(module_name)
        assert isinstance(module, PackableLinear) and module.weight is not None
        names = module.parts("weight") if isinstance(module, ColumnParallelLinear) else [None]
        missing = [p for p in names if p not in found]
        if missing:
            raise ModelLoadError(f"{path}: {module_name} has no tensor for {missing}")
        joined = join_rows([found[p] for p in names], module_name)
        if tuple(joined.q.shape) != tuple(module.weight.shape):
            raise ModelLoadError(
                f"{path}: {module_name} is {tuple(joined.q.shape)} in the file, the config "
                f"says {tuple(module.weight.shape)}"
            )
        module.quantized = pack(joined)
        module.register_parameter("weight", None)
    model.load_weights(plain)
    for module in model.modules():
        if not isinstance(module, PackableLinear) or module.quantized is None:
            continue
        bias = module.bias
        if isinstance(bias, torch.Tensor):
            module.quantized_bias = bias.detach().to(torch.float32).contiguous()
    if head is not None:
        model.lm_head_quantized = pack(head)
    return counts
