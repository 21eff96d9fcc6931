"""Load a model's weights (single-file or sharded safetensors) into the model class its
architecture names."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open

from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.loading.hub import safetensors_files
from engine.models.interface import CausalLM
from engine.models.layers.linear import CheckpointTensor
from engine.models.registry import model_class

if TYPE_CHECKING:
    from engine.loading.model_spec import ModelSpec

log = logging.getLogger(__name__)


def iter_safetensors(path: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of a single-file or sharded (index.json) safetensors checkpoint, as a lazy
    slice: a tensor-parallel rank reads only the part it indexes."""
    for name in safetensors_files(path):
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict: it has no __iter__
                yield key, f.get_slice(key)


def load_model(spec: ModelSpec, shard: Shard, device: torch.device) -> CausalLM:
    """This rank's shard of the model on `device` (a rank's own GPU), weights loaded, in eval
    mode."""
    with torch.device("meta"):
        model = model_class(spec.architecture)(spec.hf_config, shard)
    # The dtype first, on meta: materializing float32 and converting after would hold both.
    # The model stays on meta until its loader has dropped the weights it keeps quantized, so
    # that `to_empty` allocates only what stays dense.
    module = cast(torch.nn.Module, model).to(spec.dtype)
    source: Path = spec.path
    if spec.gguf_file is not None:
        from engine.loading.gguf_loader import load_gguf
        from engine.models.base import DecoderModel

        if not isinstance(model, DecoderModel):
            raise ModelLoadError(f"{spec.gguf_file}: GGUF weights are read for decoder models")
        counts = load_gguf(model, spec.gguf_file, spec.hf_config, device)
        source = spec.gguf_file
        log.info(
            "GGUF tensors read as stored: %s", ", ".join(f"{n} {t}" for t, n in counts.items())
        )
    elif spec.linear_format is not None:
        from engine.loading.quantized_checkpoint import load_quantized_checkpoint
        from engine.models.base import DecoderModel

        if not isinstance(model, DecoderModel):
            raise ModelLoadError(f"{spec.path}: quantized checkpoints are read for decoder models")
        counts = load_quantized_checkpoint(model, spec.path, spec.linear_format, device)
        log.info(
            "%s: %d linear weights read as integers, %d kept as FP8, %d de-quantized at load (FP8)",
            spec.linear_format.method,
            counts["quantized"],
            counts["fp8"],
            counts["dequantized"],
        )
    else:
        module.to_empty(device=device)
        model.load_weights(iter_safetensors(spec.path))
    module.eval()
    where = f", rank {shard.rank} of {shard.size}" if shard.size > 1 else ""
    log.info("loaded %s (%s, %s%s) from %s", spec.architecture, spec.dtype, device, where, source)
    return model
