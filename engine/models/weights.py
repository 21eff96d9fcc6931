"""Checkpoint tensors into a model's parameters: each Hugging Face name is mapped to one of
ours (and, for fused layers, a part of it); the layer that owns the parameter reads its own
slice when it has a `load` method, else the whole tensor is copied. Every parameter, and every
part of a fused one, must be set."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from engine.errors import ModelLoadError
from engine.models.layers.linear import CheckpointTensor, copy_checked

# (our parameter name, part) for a checkpoint name; None: a tensor the model does not use
Locate = Callable[[str], tuple[str, str | None] | None]


def _parts(module: nn.Module, param: str) -> list[str | None]:
    parts = getattr(module, "parts", None)
    return parts(param) if parts is not None else [None]


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], locate: Locate
) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, str | None]] = set()
    for hf_name, source in weights:
        target = locate(hf_name)
        if target is None:
            continue
        name, part = target
        if name not in params:
            raise ModelLoadError(f"checkpoint tensor {hf_name} has no place in the model")
        module_name, _, param = name.rpartition(".")
        module = model.get_submodule(module_name)
        load = getattr(module, "load", None)
        if load is None:
            copy_checked(params[name].data, source[:], hf_name)
            loaded.add((name, None))
        else:
            loaded.update((name, p) for p in load(param, source, part))
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        module_name, _, param = name.rpartition(".")
        expected.update((name, p) for p in _parts(model.get_submodule(module_name), param))
    missing = sorted(f"{n} ({p})" if p else n for n, p in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
