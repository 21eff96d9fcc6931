"""Quantized checkpoints made in tests from random-weight models: compressed-tensors' own
compressors write them (the format's reference), with scales rounded to bf16 values as real
checkpoints store them; transformers' own de-compression of them is the oracle's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def _observe(module: torch.nn.Module, args) -> None:  # type: ignore[no-untyped-def]
    """Min-max scales (and zero points) of one layer, as an observer would set them."""
    w = module.weight.data
    n, k = w.shape
    if args.type == "float":
        amax = w.abs().amax(dim=1, keepdim=True) if args.strategy == "channel" else w.abs().amax()
        scale = amax / torch.finfo(torch.float8_e4m3fn).max
        module.weight_scale.data.copy_(
            scale.to(torch.bfloat16).float().reshape_as(module.weight_scale)
        )
        return
    group = args.group_size if args.strategy == "group" else k
    grouped = w.view(n, k // group, group)
    top = 2 ** (args.num_bits - 1) - 1
    if args.symmetric:
        scale = (grouped.abs().amax(-1) / top).to(torch.bfloat16).float()
        module.weight_scale.data.copy_(scale.reshape_as(module.weight_scale))
        return
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (2**args.num_bits - 1)).to(torch.bfloat16).float()
    zero = (-(top + 1) - torch.round(lo / scale)).clamp(-(top + 1), top)
    module.weight_scale.data.copy_(scale.reshape_as(module.weight_scale))
    module.weight_zero_point.data.copy_(zero.to(torch.int8).reshape_as(module.weight_zero_point))


def compress(
    src: Path,
    dst: Path,
    preset: str,
    fmt: str,
    group_size: int | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
    weight_strategy: str | None = None,
) -> Path:
    """`src` (a float32 folder) compressed with compressed-tensors' `preset` scheme (W4A16,
    W4A16_ASYM, W8A16, FP8_DYNAMIC, ...) on every Linear, saved in `fmt`; `weight_strategy`
    overrides the preset's (FP8 with one scale per tensor: "tensor")."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    assert scheme.weights is not None
    if group_size is not None:
        scheme.weights.group_size = group_size
        scheme.weights.strategy = "group"
    elif scheme.weights.type == "int":  # one scale per output row
        scheme.weights.group_size = None
        scheme.weights.strategy = "channel"
    if weight_strategy is not None:
        scheme.weights.strategy = weight_strategy
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _observe(module, scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def decompressed(folder: Path) -> torch.nn.Module:
    """transformers' own float32 model of a compressed-tensors folder, de-compressed."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )


def edit_config(folder: Path, **changes: object) -> None:
    """Set keys of config.json's quantization_config (dotted paths into it)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for dotted, value in changes.items():
        node = config["quantization_config"]
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
    path.write_text(json.dumps(config))
