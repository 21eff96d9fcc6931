"""GPTQ and AWQ checkpoints made in tests from their documented layouts (their own packers,
gptqmodel and autoawq, need CUDA builds): known integers, zero points and float16 scales are
packed here with plain integer arithmetic, independently of the loader's unpacking, and the
float32 weights they stand for are written beside as a dense folder for transformers."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each of a word's eight slots holds


@dataclass(frozen=True)
class Layout:
    method: str  # gptq or awq
    bits: int = 4
    group_size: int = 32  # -1: one group a row
    checkpoint_format: str = "gptq"  # gptq: zero points stored less one; gptq_v2: as they are
    desc_act: bool = False
    extra: dict[str, object] = field(default_factory=dict)  # more quantization_config keys


@dataclass(frozen=True)
class Expected:
    """One layer's integers as the kernel should hold them, and its float32 weight."""

    q: torch.Tensor  # [out, in], the values 0 .. 2**bits - 1
    scales: torch.Tensor  # float32 [out, groups]
    weight: torch.Tensor  # float32 [out, in]


def pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """Consecutive values along the last axis into int32 words, value i at bit i * bits."""
    per = 32 // bits
    grouped = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    words = np.zeros(grouped.shape[:-1], dtype=np.uint64)
    for i in range(per):
        words |= grouped[..., i] << np.uint64(i * bits)
    return words.astype(np.uint32).view(np.int32)


def _awq_slots(values: np.ndarray) -> np.ndarray:
    """Columns in order -> in the order AWQ's words hold them."""
    rows, cols = values.shape
    return values.reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)].reshape(rows, cols)


def write_checkpoint(
    src: Path, dst: Path, dense: Path, layout: Layout, seed: int = 0
) -> dict[str, Expected]:
    """`src`'s linears replaced by random integers in `layout` (into `dst`), and by the weights
    they stand for (into `dense`); each quantized layer's expected values by its name."""
    rng = np.random.default_rng(seed)
    shutil.copytree(src, dst)
    shutil.copytree(src, dense)
    tensors = load_file(str(src / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    plain = dict(tensors)
    expected: dict[str, Expected] = {}
    top = 1 << layout.bits
    # Layers the config leaves dense (AWQ's modules_to_not_convert: substrings of their names,
    # as AutoAWQ matches them) keep their float weights in both folders.
    listed = layout.extra.get("modules_to_not_convert")
    skip = [str(s) for s in listed] if isinstance(listed, list) else []
    linears = [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]
    for name in [n for n in linears if not any(s in n for s in skip)]:
        prefix = name.removesuffix(".weight")
        n, k = tensors[name].shape
        group = k if layout.group_size == -1 else layout.group_size
        groups = k // group
        q = rng.integers(0, top, (n, k))
        zeros = rng.integers(1, top, (n, groups))  # from 1: GPTQ's format stores zero - 1
        scales = (rng.uniform(0.5, 1.5, (n, groups)) * 0.04 / top).astype(np.float16)
        s32 = torch.from_numpy(scales.astype(np.float32))
        by_input = np.repeat(np.arange(groups), group)
        weight = (q - zeros[:, by_input]) * scales.astype(np.float64)[:, by_input]
        expected[prefix] = Expected(torch.from_numpy(q), s32, torch.from_numpy(weight).float())
        plain[name] = expected[prefix].weight
        del tensors[name]
        stored_zeros = zeros - 1 if layout.checkpoint_format == "gptq" else zeros
        if layout.method == "gptq":
            # [in / per word, out]: each output column's inputs packed down the rows.
            words = np.ascontiguousarray(pack_words(q, layout.bits).T)
            packed[f"{prefix}.qweight"] = torch.from_numpy(words)
            packed[f"{prefix}.qzeros"] = torch.from_numpy(pack_words(stored_zeros.T, layout.bits))
            packed[f"{prefix}.g_idx"] = torch.from_numpy(by_input.astype(np.int32))
        else:
            packed[f"{prefix}.qweight"] = torch.from_numpy(pack_words(_awq_slots(q.T), 4))
            packed[f"{prefix}.qzeros"] = torch.from_numpy(pack_words(_awq_slots(zeros.T), 4))
        packed[f"{prefix}.scales"] = torch.from_numpy(np.ascontiguousarray(scales.T))
    save_file({**tensors, **packed}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(plain, str(dense / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if layout.method == "gptq":
        settings = {
            "quant_method": "gptq",
            "bits": layout.bits,
            "group_size": layout.group_size,
            "desc_act": layout.desc_act,
            "sym": False,
            "checkpoint_format": layout.checkpoint_format,
        }
    else:
        settings = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": layout.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    config["quantization_config"] = {**settings, **layout.extra}
    (dst / "config.json").write_text(json.dumps(config))
    return expected
