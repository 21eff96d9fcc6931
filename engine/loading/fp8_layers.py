"""A checkpoint's FP8 (float8_e4m3fn) linear weights, two ways:

- where an FP8 matmul runs (a GPU of compute capability 8.9+, as for --quantization fp8), each
  linear keeps the checkpoint's own e4m3 bytes and scales, as an `Fp8Weight` that
  engine/worker/gpu_quantize.py moves to the device; a fused layer's parts (q/k/v, gate/up) are
  stacked by rows, each part's scale repeated over its rows, so a per-tensor scale becomes a
  per-row one (the per-token activations take `_scaled_mm`'s row-wise path either way);
- elsewhere (the CPU, older GPUs) each layer is read from the file and de-quantized into the
  model's dtype only when the model's loader asks for it, one layer at a time.

float32 holds an e4m3 value times a bf16 or float32 scale exactly (4 + 8 significant bits, or
the scale's 24 rounded once), so de-quantizing in float32 row blocks and rounding once to the
model's dtype gives what a whole float32 copy would."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.loading.quantized_linears import check_rows, part_names, read_layer
from engine.models.base import DecoderModel
from engine.models.layers.linear import CheckpointTensor, PackableLinear
from kernels.gpu_quant.fp8 import FP8, Fp8Weight

log = logging.getLogger(__name__)

# Values de-quantized at a time: bounds the float32 scratch to 4 MiB whatever the layer, in few
# enough steps that a small model's layers take one each.
VALUES_AT_A_TIME = 1 << 20


@dataclass(frozen=True)
class Fp8Stored:
    """One checkpoint tensor's FP8 weight as stored."""

    q: torch.Tensor  # float8_e4m3fn [n, k]: the file's bytes
    scales: torch.Tensor  # float32 [n]: the row's scale (a per-tensor one repeated)

    def __post_init__(self) -> None:
        if self.q.dtype != FP8 or self.q.dim() != 2:
            raise ValueError(f"an FP8 weight is 2-D float8_e4m3fn, not {self.q.dtype}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != self.q.shape[:1]:
            raise ValueError(f"scales {tuple(self.scales.shape)}: float32, one per row")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """q * scale, computed in float32 and rounded once to `dtype`."""
        n, k = self.q.shape
        out = torch.empty(self.q.shape, dtype=dtype)
        step = max(1, VALUES_AT_A_TIME // max(k, 1))
        for start in range(0, n, step):
            stop = min(start + step, n)
            rows = self.q[start:stop].to(torch.float32) * self.scales[start:stop, None]
            out[start:stop].copy_(rows)
        return out


@dataclass(frozen=True)
class Fp8Layer:
    """A linear's FP8 weight, not read yet: the format's reader and whether the platform's FP8
    matmul runs it (else it is de-quantized on the way into the model)."""

    prefix: str
    read: Callable[[], Fp8Stored]
    kept: bool


def join_fp8(parts: list[Fp8Stored], what: str) -> Fp8Weight:
    """Parts stacked by output rows, bytes unchanged, each row with its own part's scale."""
    columns = {int(p.q.shape[1]) for p in parts}
    if len(columns) != 1:
        raise ModelLoadError(f"{what}: its parts have {sorted(columns)} input features")
    q = torch.cat([p.q for p in parts]).contiguous()
    scales = torch.cat([p.scales for p in parts]).contiguous()
    return Fp8Weight(q, scales, activations="token")


def _stored(layer: Fp8Layer, path: Path) -> Fp8Stored:
    return read_layer(layer.read, path, layer.prefix, "FP8")


def place_fp8(
    model: DecoderModel, parts: dict[str, dict[str | None, Fp8Layer]], path: Path
) -> list[Fp8Layer]:
    """Each module's FP8 parts (keyed as quantized_linears.part_names names them) read, joined
    and kept in it, one module at a time, its float weight dropped. A module the FP8 matmul
    cannot take whole is returned to be de-quantized instead, as every FP8 layer was before:
    a part kept dense or weight-only (a fused layer runs one way), or a size `_scaled_mm`'s
    GPU kernels do not take (multiples of 16)."""
    dequantize: list[Fp8Layer] = []
    for module_name, found in parts.items():
        module = model.get_submodule(module_name)
        assert isinstance(module, PackableLinear) and module.weight is not None
        names = part_names(module, found)
        n, k = module.weight.shape
        why_not = None
        if any(p not in found for p in names):
            why_not = "not all of its parts are FP8 with FP8 activations"
        elif n % 16 or k % 16:
            why_not = f"FP8 matmuls take multiples of 16, not [{n}, {k}]"
        if why_not is not None:
            log.info("%s: %s de-quantized at load (%s)", path, module_name, why_not)
            dequantize.extend(found.values())
            continue
        joined = join_fp8([_stored(found[p], path) for p in names], f"{path}: {module_name}")
        check_rows(module, joined.q.shape, f"{path}: {module_name}")
        module.gpu_quantized = joined
        module.register_parameter("weight", None)
    return dequantize


def dequantized_one_by_one(
    model: DecoderModel,
    weights: Iterable[tuple[str, torch.Tensor | Fp8Layer]],
    path: Path,
) -> Iterator[tuple[str, CheckpointTensor]]:
    """The weights as the model's loader consumes them: an FP8 layer is read and de-quantized
    into its parameter's dtype only when its turn comes, so one layer's copy is alive at a
    time."""
    for name, weight in weights:
        if not isinstance(weight, Fp8Layer):
            yield name, weight
            continue
        target = model._locate(name)
        assert target is not None  # the loader found its module before deferring it
        dtype = model.get_parameter(target[0]).dtype
        yield name, _stored(weight, path).dequantized(dtype)
