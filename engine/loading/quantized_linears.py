"""Quantized weights into a loaded-shape model, whatever file they came from (GGUF blocks, a
quantized checkpoint's integers): the parts of a fused layer (q/k/v, gate/up) joined by rows,
checked against the layer's shape, packed for the CPU kernel, and the float weight dropped
while the model is still on the meta device, so that it is never allocated."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch

from engine.errors import ModelLoadError
from engine.models.base import DecoderModel
from engine.models.layers.linear import ColumnParallelLinear, PackableLinear
from kernels.cpu.quant_layout import QuantizedWeight, pack

T = TypeVar("T")


def read_layer(read: Callable[[], T], path: Path, prefix: str, method: str) -> T:
    """A layer's tensors read by a format's reader, whatever goes wrong a ModelLoadError that
    names the file and the layer."""
    try:
        return read()
    except ModelLoadError as exc:
        message = str(exc)
        raise ModelLoadError(
            message if message.startswith(str(path)) else f"{path}: {message}"
        ) from exc
    except (ValueError, IndexError, RuntimeError, TypeError) as exc:
        # A tensor of the wrong rank, dtype or size that a reader's checks let through.
        raise ModelLoadError(
            f"{path}: {prefix} ({method}) cannot be read: {type(exc).__name__}: {exc}"
        ) from exc


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


class QuantizedPlacer:
    """Packs each quantized module into the model as soon as all its parts are read (q/k/v,
    gate/up), so at most the module being read has its unpacked integers (a byte a weight)
    alive. Meant for a model still on the meta device: the module's weight, whose shape is
    checked, is dropped before `to_empty` would allocate it densely."""

    def __init__(self, model: DecoderModel, path: Path) -> None:
        self.model, self.path = model, path
        self.pending: dict[str, dict[str | None, QuantizedWeight]] = {}
        self.placed: set[str] = set()
        self.count = 0  # the tensors packed (a fused module's parts one each)

    def add(self, module_name: str, part: str | None, weight: QuantizedWeight) -> None:
        """One tensor's integers (keyed as the model's loader names its part; None: the whole
        layer, or a tensor that already fuses every part, as Phi-3's qkv)."""
        if module_name in self.placed:
            raise ModelLoadError(f"{self.path}: {module_name} ({part}) is stored twice")
        found = self.pending.setdefault(module_name, {})
        found[part] = weight
        names = self._names(module_name, found)
        if all(p in found for p in names):
            self._place(module_name, [found[p] for p in names])
            self.count += len(found)
            self.placed.add(module_name)
            del self.pending[module_name]

    def finish(self) -> None:
        """Every module whose tensors were read is packed: a ModelLoadError for one missing a
        part."""
        for module_name, found in self.pending.items():
            missing = [p for p in self._names(module_name, found) if p not in found]
            raise ModelLoadError(
                f"{self.path}: {module_name} has no quantized tensor for {missing}"
            )

    def _names(
        self, module_name: str, found: dict[str | None, QuantizedWeight]
    ) -> list[str | None]:
        return part_names(self.model.get_submodule(module_name), found)

    def _place(self, module_name: str, parts: list[QuantizedWeight]) -> None:
        module = self.model.get_submodule(module_name)
        joined = join_rows(parts, module_name)
        check_rows(module, joined.q.shape, f"{self.path}: {module_name}")
        assert isinstance(module, PackableLinear)
        module.quantized = pack(joined)
        module.register_parameter("weight", None)


def part_names(module: torch.nn.Module, found: Iterable[str | None]) -> list[str | None]:
    """The tensors a linear's weight is read from, keyed as the model's loader names its parts:
    [None] for the whole layer (also a tensor that already fuses every part, as Phi-3's qkv),
    else a fused layer's parts (q, k, v; gate, up)."""
    if None in found or not isinstance(module, ColumnParallelLinear):
        return [None]
    return list(module.parts("weight"))


def check_rows(module: torch.nn.Module, shape: torch.Size, what: str) -> None:
    """A weight joined from the file has the shape of the layer's (meta) weight."""
    assert isinstance(module, PackableLinear) and module.weight is not None
    if tuple(shape) != tuple(module.weight.shape):
        raise ModelLoadError(
            f"{what} is {tuple(shape)} in the file, the config says {tuple(module.weight.shape)}"
        )


def keep_quantized_biases(model: DecoderModel) -> None:
    """A quantized layer's bias in float32, as the kernel adds it (after the model's own loader
    filled the bias)."""
    for module in model.modules():
        quantized = isinstance(module, PackableLinear) and module.quantized is not None
        if quantized and isinstance(module.bias, torch.Tensor):
            module.quantized_bias = module.bias.detach().to(torch.float32).contiguous()
