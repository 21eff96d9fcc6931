"""A GGUF file's tensors as Hugging Face names and either plain tensors or quantized blocks
(kernels/cpu/quant_layout), read with the `gguf` package: the block types of gguf_blocks (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) become the quantized kernel's integers, scales and
mins directly, never bf16. Llama-architecture files
(llama.cpp's own name scheme; its converter permutes the q and k rows for its rotary layout,
which is undone here on the integer rows, exactly). What cannot be read is a ModelLoadError
naming the file and the tensor."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.loading.gguf_blocks import BLOCK_TYPES, decode
from engine.loading.gguf_reader import open_gguf
from kernels.cpu.quant_layout import QuantizedWeight

QUANTIZED = BLOCK_TYPES
DENSE = {"F32": np.float32, "F16": np.float16}

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: one the model does not use, such as a
    rotary frequency table that the config describes)."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match is not None:
        layer, kind, what = match.groups()
        return f"model.layers.{layer}.{_LAYER[kind]}.{what}" if kind in _LAYER else None
    base, _, what = name.rpartition(".")
    return f"{_TOP[base]}.{what}" if base in _TOP else None


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # GGUF's
    hf_name: str
    type: str
    data: np.ndarray  # as the file holds it: [rows, bytes] for quantized types


def _architecture(reader: object, path: Path) -> str:
    field = reader.fields.get("general.architecture")  # type: ignore[attr-defined]
    if field is None:
        raise ModelLoadError(f"{path}: no general.architecture in its metadata")
    return bytes(field.parts[field.data[0]]).decode()


def read_tensors(path: Path) -> Iterator[GGUFTensor]:
    """Every tensor the model uses, checked against the size its type and shape require."""
    reader = open_gguf(path)
    arch = _architecture(reader, path)
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r}; pagedserve reads llama files")
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in QUANTIZED and kind not in DENSE:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is {kind}, which pagedserve does not read "
                f"(it reads {', '.join([*DENSE, *QUANTIZED])})"
            )
        elements = int(np.prod(tensor.shape))
        if kind in QUANTIZED:
            block = QUANTIZED[kind]
            if len(tensor.shape) != 2:  # blocks are read as a matrix's rows
                raise ModelLoadError(
                    f"{path}: tensor {tensor.name} is {kind} with shape {list(tensor.shape)}; "
                    "pagedserve reads quantized blocks for matrices only"
                )
            expected = elements // block.values * block.nbytes
            if elements % block.values or int(tensor.shape[0]) % block.values:
                raise ModelLoadError(
                    f"{path}: tensor {tensor.name} ({kind}) rows of {tensor.shape[0]} values are "
                    f"not whole blocks of {block.values}"
                )
        else:
            expected = elements * np.dtype(DENSE[kind]).itemsize
        if tensor.data.nbytes != expected:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} holds {tensor.data.nbytes} bytes, its type {kind} "
                f"and shape {list(tensor.shape)} need {expected}: the file is truncated or corrupt"
            )
        yield GGUFTensor(tensor.name, name, kind, tensor.data)


def dense(tensor: GGUFTensor) -> torch.Tensor:
    """A plain tensor in float32 (or float16 as stored), in Hugging Face's [out, in] order."""
    return torch.from_numpy(np.array(tensor.data, dtype=DENSE[tensor.type]))


def quantized(tensor: GGUFTensor) -> QuantizedWeight:
    """A quantized tensor's blocks as the kernel's integers, scales and mins."""
    return decode(tensor.type, tensor.data)


def unpermute_rows(weight: QuantizedWeight, heads: int) -> QuantizedWeight:
    """llama.cpp's converter stores each q (k) head's rows as interleaved pairs of the rotary
    halves; Hugging Face's layout has the halves apart. A permutation of whole rows, so the
    blocks move as they are."""
    order = _unpermuted_order(weight.q.shape[0], heads)
    mins = None if weight.mins is None else weight.mins[order]
    return QuantizedWeight(weight.q[order], weight.scales[order], mins, weight.bits)


def unpermute_dense(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight[_unpermuted_order(weight.shape[0], heads)]


def _unpermuted_order(n: int, heads: int) -> torch.Tensor:
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
