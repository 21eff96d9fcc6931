"""A Hugging Face checkpoint whose config.json has a `quantization_config` (compressed-tensors,
GPTQ, AWQ): its format detected, and its quantized linear weights read straight into the
quantized kernel's layout (kernels/cpu/quant_layout), the fused q/k/v and gate/up rows joined;
FP8 weights kept as stored where a GPU runs them (engine/loading/fp8_layers.py); the rest
(norms, embeddings, layers the config leaves dense, FP8 weights de-quantized one layer at a time)
through the model's own loader, lazily."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from config import ConfigError
from engine.errors import ModelLoadError
from engine.loading.compressed_tensors import CompressedTensorsFormat, parse_compressed_tensors
from engine.loading.fp8_layers import Fp8Layer, dequantized_one_by_one, place_fp8
from engine.loading.gptq_awq import parse_gptq_awq
from engine.loading.hub import safetensors_files
from engine.loading.linear_format import LinearFormat
from engine.loading.quantized_linears import QuantizedPlacer, keep_quantized_biases, read_layer
from engine.models.base import DecoderModel
from engine.models.layers.linear import CheckpointTensor, PackableLinear, ParallelLMHead

# quant_method -> the --quantization names that agree with it.
METHODS = {"compressed-tensors": ("compressed-tensors",), "gptq": ("gptq",), "awq": ("awq",)}


def declared_quantization(hf_config: PretrainedConfig) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return config if isinstance(config, dict) else dict(config.to_dict())


def resolve_format(config: dict[str, Any], path: Path) -> LinearFormat:
    """The checkpoint's format, or a ConfigError naming what in its config cannot be served."""
    where = f"{path / 'config.json'}"
    method = config.get("quant_method")
    try:
        if method == "compressed-tensors":
            return parse_compressed_tensors(config, where)
        if method in ("gptq", "awq"):
            return parse_gptq_awq(config, where)
    except ConfigError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        # A field of another type than the format's (a list for a mapping, a string for a list).
        raise ConfigError(
            f"{where}: quantization_config is malformed ({type(exc).__name__}: {exc})"
        ) from exc
    raise ConfigError(
        f"{where}: quantization_config.quant_method is {method!r}; pagedserve serves "
        f"{', '.join(METHODS)} checkpoints"
    )


def flag_agrees(named: str, fmt: LinearFormat) -> bool:
    """--quantization `named` names this checkpoint's format (fp8: compressed-tensors' FP8)."""
    if named == "fp8":
        return isinstance(fmt, CompressedTensorsFormat) and fmt.float_weights
    return named in METHODS[fmt.method]


class _Checkpoint:
    """The checkpoint's tensor names, file by file, read on demand."""

    def __init__(self, path: Path) -> None:
        self.files = {
            name: safe_open(str(path / name), framework="pt") for name in safetensors_files(path)
        }
        self.where = {key: name for name, f in self.files.items() for key in f.keys()}  # noqa: SIM118

    def slice(self, key: str) -> CheckpointTensor:
        return self.files[self.where[key]].get_slice(key)

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise ModelLoadError(f"{key}: no such tensor in the checkpoint")
        return self.files[self.where[key]].get_tensor(key)


def load_quantized_checkpoint(
    model: DecoderModel, path: Path, fmt: LinearFormat, device: torch.device
) -> dict[str, int]:
    """Fill `model`, built on the meta device, from the checkpoint at `path`: the integer
    layers are packed first, one module at a time, and FP8 layers kept as stored where a GPU
    runs them; then the parameters that stay dense are allocated on `device` and read (FP8 ones
    de-quantized one at a time). Counts of linear weights read as integers (`quantized`), kept
    as the checkpoint's FP8 (`fp8`) and de-quantized at load (`dequantized`)."""
    ckpt = _Checkpoint(path)
    layers: dict[str, set[str]] = {}
    for key in ckpt.where:
        prefix, _, name = key.rpartition(".")
        layers.setdefault(prefix, set()).add(name)
    quantized = {p for p, names in layers.items() if fmt.stores_quantized(p, names)}
    _refuse_dense(model, layers, fmt, path)
    placer = QuantizedPlacer(model, path)
    fp8: dict[str, dict[str | None, Fp8Layer]] = {}
    dense: list[tuple[str, torch.Tensor | Fp8Layer]] = []
    # A module's parts one after another (q, k, v apart from o): each module is packed as soon
    # as its last part is read.
    for prefix in sorted(quantized, key=lambda p: (_module_of(model, p), p)):
        target = model._locate(f"{prefix}.weight")
        module = None if target is None else model.get_submodule(target[0].rpartition(".")[0])
        if not isinstance(module, PackableLinear):
            raise ModelLoadError(
                f"{path}: {prefix} is stored quantized, but pagedserve reads quantized weights "
                "only for linear layers"
            )
        assert target is not None

        def tensor(name: str, prefix: str = prefix) -> torch.Tensor:
            key = f"{prefix}.{name}"
            if key not in ckpt.where:
                raise ModelLoadError(f"{path}: no tensor {key} (its layer is {fmt.method})")
            return ckpt.tensor(key)

        weight = read_layer(partial(fmt.read, prefix, tensor), path, prefix, fmt.method)
        if isinstance(weight, Fp8Layer) and weight.kept and not isinstance(module, ParallelLMHead):
            fp8.setdefault(target[0].rpartition(".")[0], {})[target[1]] = weight
        elif isinstance(weight, (torch.Tensor, Fp8Layer)):  # FP8 here: read as the model loads
            dense.append((f"{prefix}.weight", weight))
        else:
            placer.add(target[0].rpartition(".")[0], target[1], weight)
    placer.finish()
    not_kept = place_fp8(model, fp8, path)
    dense.extend((f"{layer.prefix}.weight", layer) for layer in not_kept)
    model.to_empty(device=device)  # only what stays dense: the placed layers have no weight
    model.load_weights(chain(_plain(ckpt, quantized), dequantized_one_by_one(model, dense, path)))
    keep_quantized_biases(model)
    kept = sum(len(found) for found in fp8.values()) - len(not_kept)
    return {"quantized": placer.count, "fp8": kept, "dequantized": len(dense)}


def _module_of(model: DecoderModel, prefix: str) -> str:
    """The model's module that a checkpoint layer's weight goes to ("" where none)."""
    target = model._locate(f"{prefix}.weight")
    return "" if target is None else target[0].rpartition(".")[0]


def _refuse_dense(
    model: DecoderModel, layers: dict[str, set[str]], fmt: LinearFormat, path: Path
) -> None:
    """A dense weight where the config says the linear is quantized: its quantized tensors
    (scales) are missing, or the config lies."""
    for prefix, names in layers.items():
        if "weight" not in names or fmt.stores_quantized(prefix, names):
            continue
        if not fmt.expects_quantized(prefix):
            continue
        target = model._locate(f"{prefix}.weight")
        module = None if target is None else model.get_submodule(target[0].rpartition(".")[0])
        if isinstance(module, PackableLinear):
            raise ModelLoadError(
                f"{path}: tensor {prefix}.weight is dense, but the config quantizes {prefix} "
                f"({fmt.method}): its quantized tensors (scales) are missing"
            )


def _plain(ckpt: _Checkpoint, quantized: set[str]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's other tensors, lazily (a quantized layer's bias among them)."""
    for key in ckpt.where:
        prefix, _, name = key.rpartition(".")
        if prefix not in quantized or name == "bias":
            yield key, ckpt.slice(key)
