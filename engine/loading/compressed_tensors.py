"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor saves
them) read for the CPU's quantized kernel, weights only:

- `pack-quantized`: int4 or int8 integers packed into int32 words (`weight_packed`, the values
  offset by 2**(bits-1) so that they are unsigned), `weight_scale` per output row and group, and
  for asymmetric schemes `weight_zero_point` packed the same way along the output rows.
- `int-quantized` / `naive-quantized`: int8 `weight` with its `weight_scale` (and zero point).
- `float-quantized`: FP8 (e4m3) `weight` with a per-tensor or per-row scale, read as an
  `Fp8Layer` (engine/loading/fp8_layers.py): kept as stored for a GPU's FP8 matmul where one
  runs (`fp8_kernel`, set at start-up), else de-quantized into the model's dtype layer by layer
  as the model loads (the CPU kernel has no FP8 path, and an e4m3 value is not an integer times
  a shared scale).

The value of an integer weight is (q - zero point) * scale. The kernel's is q' * scale + min, so
4-bit weights keep the unsigned stored value (q' = q + 8) with min = -(8 + zero point) * scale,
8-bit ones the signed value with min = -zero point * scale. With the scales in bf16 or fp16, as
checkpoints store them, both sides are exact in float32.

Integer weights with dynamic symmetric int8 activations (W8A8, W4A8) run as
`--quantize-activations int8` runs (activations rounded per block of 32 inputs, at least as fine
as the checkpoint's per-token scale) where that runs, else with 16-bit activations.

Anything else a config may say (other activation quantization, 2:4
sparsity, transforms, a quantized KV cache, block or tensor-group strategies, other formats) is
refused at start-up with the field named. Layers named in `ignore` stay dense."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from config import ConfigError
from engine.errors import ModelLoadError
from engine.loading.fp8_layers import Fp8Layer, Fp8Stored
from engine.loading.int_packing import unpack_words
from engine.loading.linear_format import Tensors, check_shape, group_count
from kernels.cpu.quant_layout import QuantizedWeight

INT_FORMATS = {"pack-quantized": (4, 8), "int-quantized": (8,), "naive-quantized": (8,)}
FLOAT_FORMAT = "float-quantized"
STRATEGIES = {"int": ("group", "channel", "tensor"), "float": ("channel", "tensor")}


@dataclass(frozen=True)
class WeightScheme:
    name: str  # its key in config_groups
    format: str
    targets: tuple[str, ...]
    num_bits: int
    type: str  # int or float
    symmetric: bool
    strategy: str
    group_size: int | None
    # FP8 weights whose activations the checkpoint declares dynamic FP8 (FP8_DYNAMIC); without
    # them a checkpoint means 16-bit activations (weight-only FP8).
    fp8_activations: bool = False
    # Integer weights whose activations the checkpoint declares dynamic int8 (W8A8, W4A8): run
    # with --quantize-activations int8's integer products where those run.
    int8_activations: bool = False


def _matches(target: str, prefix: str) -> bool:
    if target == "Linear":  # every layer the loader asks about is a linear one
        return True
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return prefix == target or prefix.endswith("." + target)


@dataclass(frozen=True)
class CompressedTensorsFormat:
    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]
    method: str = "compressed-tensors"
    # FP8 weights run as stored through torch._scaled_mm (a GPU of compute capability 8.9+);
    # else de-quantized at load. Set by the start-up once the platform is known.
    fp8_kernel: bool = False

    @property
    def float_weights(self) -> bool:
        return all(s.type == "float" for s in self.schemes)

    @property
    def has_float(self) -> bool:
        return any(s.type == "float" for s in self.schemes)

    @property
    def int8_activations(self) -> bool:
        """Every integer scheme declares dynamic int8 activations (a checkpoint mixing them with
        weight-only schemes keeps 16-bit activations: the flag applies to every linear)."""
        ints = [s for s in self.schemes if s.type == "int"]
        return bool(ints) and all(s.int8_activations for s in ints)

    def describe(self) -> str:
        parts = [
            f"{s.format} {s.type}{s.num_bits} {s.strategy}"
            + (f" {s.group_size}" if s.strategy == "group" else "")
            + ("" if s.symmetric else " asymmetric")
            + (" with dynamic int8 activations" if s.int8_activations else "")
            for s in self.schemes
        ]
        how = "integers read as stored"
        if self.has_float:
            # Say where the memory and speed went.
            dynamic = [s.fp8_activations for s in self.schemes if s.type == "float"]
            if self.fp8_kernel and any(dynamic):
                how = (
                    "FP8 weights kept as stored, run through torch._scaled_mm (FP8 activations "
                    "per token)"
                )
                if not all(dynamic):
                    how += "; weight-only FP8 schemes de-quantized at load (16-bit activations)"
            elif self.fp8_kernel:
                how = "weight-only FP8 (16-bit activations): de-quantized at load to the model's dtype"
            else:
                how = "FP8 weights de-quantized at load to the model's dtype"
        return f"compressed-tensors ({', '.join(parts)}): {how}"

    def scheme_of(self, prefix: str) -> WeightScheme | None:
        if any(_matches(t, prefix) for t in self.ignore):
            return None
        # A layer named exactly wins over a regex, which wins over the class name.
        for rank in (2, 1, 0):
            for scheme in self.schemes:
                for target in scheme.targets:
                    kind = 0 if target == "Linear" else 1 if target.startswith("re:") else 2
                    if kind == rank and _matches(target, prefix):
                        return scheme
        return None

    def stores_quantized(self, prefix: str, names: set[str]) -> bool:
        return "weight_packed" in names or "weight_scale" in names

    def expects_quantized(self, prefix: str) -> bool:
        return self.scheme_of(prefix) is not None

    def read(self, prefix: str, tensors: Tensors) -> QuantizedWeight | Fp8Layer:
        scheme = self.scheme_of(prefix)
        if scheme is None:
            raise ModelLoadError(
                f"{prefix} has quantized tensors, but no config_groups target of its config "
                "names it (or `ignore` does)"
            )
        if scheme.type == "float":
            # Read when the loader asks: placed as FP8, or de-quantized as the model loads.
            # Weight-only FP8 is not run as FP8 x FP8: that would quantize the activations the
            # checkpoint keeps in 16 bits.
            kept = self.fp8_kernel and scheme.fp8_activations
            return Fp8Layer(prefix, lambda: _float_weight(prefix, scheme, tensors), kept=kept)
        return _int_weight(prefix, scheme, tensors)


def _scales(prefix: str, scheme: WeightScheme, tensors: Tensors, n: int, k: int) -> torch.Tensor:
    scale = tensors("weight_scale").to(torch.float32)
    what = f"{prefix}.weight_scale"
    if scheme.strategy == "tensor":
        if scale.numel() != 1:
            raise ModelLoadError(f"tensor {what} is {tuple(scale.shape)}, per-tensor needs one")
        return scale.reshape(1, 1).expand(n, 1).contiguous()
    groups = group_count(k, scheme.group_size if scheme.strategy == "group" else None, what)
    check_shape(scale, (n, groups), what)
    return scale.contiguous()


def _int_weight(prefix: str, scheme: WeightScheme, tensors: Tensors) -> QuantizedWeight:
    bits, offset = scheme.num_bits, 1 << (scheme.num_bits - 1)
    if scheme.format == "pack-quantized":
        shape = tensors("weight_shape")
        if shape.numel() != 2:
            raise ModelLoadError(f"tensor {prefix}.weight_shape is {shape.tolist()}, not [out, in]")
        n, k = (int(v) for v in shape.tolist())
        packed = tensors("weight_packed")
        check_shape(packed, (n, math.ceil(k * bits / 32)), f"{prefix}.weight_packed")
        stored = unpack_words(packed, bits, dim=1)[:, :k]  # q + offset, unsigned
    else:
        weight = tensors("weight")
        if weight.dtype != torch.int8:
            raise ModelLoadError(
                f"tensor {prefix}.weight is {weight.dtype}, {scheme.format} is int8"
            )
        n, k = weight.shape
        stored = weight.to(torch.int32) + offset
    scales = _scales(prefix, scheme, tensors, n, k)
    groups = scales.shape[1]
    zero = torch.zeros_like(scales)
    if not scheme.symmetric:
        point = tensors("weight_zero_point")
        what = f"{prefix}.weight_zero_point"
        if scheme.format == "pack-quantized":
            check_shape(point, (math.ceil(n * bits / 32), groups), what)
            zero = (unpack_words(point, bits, dim=0)[:n] - offset).to(torch.float32)
        else:
            check_shape(point, (n, groups), what)
            zero = point.to(torch.float32)
    if bits == 4:  # the unsigned stored value and a min, both exact
        return QuantizedWeight(stored.to(torch.int8), scales, -(offset + zero) * scales, bits=4)
    mins = None if scheme.symmetric else -zero * scales
    return QuantizedWeight((stored - offset).to(torch.int8), scales, mins, bits=8)


def _float_weight(prefix: str, scheme: WeightScheme, tensors: Tensors) -> Fp8Stored:
    weight = tensors("weight")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelLoadError(
            f"tensor {prefix}.weight is {weight.dtype} {tuple(weight.shape)}, float-quantized "
            "is 2-D e4m3"
        )
    n, k = weight.shape
    return Fp8Stored(weight, _scales(prefix, scheme, tensors, n, k).reshape(n))


def _field(where: str, path: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"{where}: quantization_config.{path} is {value!r}; {why}")


def _scheme(where: str, name: str, group: dict[str, Any], fallback: str | None) -> WeightScheme:
    path = f"config_groups.{name}"
    fmt = group.get("format") or fallback
    if fmt not in INT_FORMATS and fmt != FLOAT_FORMAT:
        raise _field(
            where,
            f"{path}.format",
            fmt,
            f"pagedserve reads {', '.join([*INT_FORMATS, FLOAT_FORMAT])}",
        )
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _field(where, f"{path}.weights", weights, "weight-only schemes need weights")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind == "int" and fmt in INT_FORMATS:
        if bits not in INT_FORMATS[fmt]:
            raise _field(
                where, f"{path}.weights.num_bits", bits, f"{fmt} is read with {INT_FORMATS[fmt]}"
            )
    elif kind == "float" and fmt == FLOAT_FORMAT:
        if bits != 8:
            raise _field(where, f"{path}.weights.num_bits", bits, "FP8 (e4m3) weights only")
    else:
        raise _field(where, f"{path}.weights.type", kind, f"not a type of {fmt}")
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES[kind]:
        raise _field(
            where, f"{path}.weights.strategy", strategy, f"{kind} weights: {STRATEGIES[kind]}"
        )
    symmetric = bool(weights.get("symmetric", True))
    if not symmetric and (kind == "float" or strategy == "tensor"):
        raise _field(where, f"{path}.weights.symmetric", False, "only int group/channel")
    group_size = weights.get("group_size")
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise _field(where, f"{path}.weights.group_size", group_size, "a group strategy needs one")
    if weights.get("actorder") == "group":
        # Groups in activation order index the scales through g_idx; the kernel's groups are
        # runs of consecutive inputs.
        raise _field(where, f"{path}.weights.actorder", "group", "groups in input order only")
    acts = group.get("input_activations")
    if acts is not None and _activations(acts) != kind:
        raise _field(
            where,
            f"{path}.input_activations",
            acts,
            "of quantized activations, FP8 weights' dynamic FP8 ones and integer weights' "
            "dynamic symmetric int8 ones (per token or tensor) are accepted",
        )
    if group.get("output_activations") is not None:
        raise _field(where, f"{path}.output_activations", group["output_activations"], "none")
    targets = group.get("targets") or []
    for target in targets:
        if target != "Linear" and not target.startswith("re:") and target[:1].isupper():
            raise _field(where, f"{path}.targets", targets, "Linear layers only")
    return WeightScheme(
        name,
        fmt,
        tuple(targets),
        int(bits),
        kind,
        symmetric,
        strategy,
        group_size,
        # Only the weights' own kind of dynamic activations gets this far.
        fp8_activations=acts is not None and kind == "float",
        int8_activations=acts is not None and kind == "int",
    )


def _activations(acts: object) -> str | None:
    """The weight type whose declared activations these are (float: dynamic FP8; int: dynamic
    symmetric int8 per token or per tensor, which int8 rounding per block of 32 inputs matches or
    refines), or None for any other (static scales, asymmetric, other widths)."""
    if not isinstance(acts, dict) or acts.get("dynamic") is not True or acts.get("num_bits") != 8:
        return None
    if acts.get("type") == "float":
        return "float"
    symmetric = acts.get("symmetric", True) is True
    if acts.get("type") == "int" and symmetric and acts.get("strategy") in ("token", "tensor"):
        return "int"
    return None


def parse_compressed_tensors(config: dict[str, Any], where: str) -> CompressedTensorsFormat:
    """The config's weight schemes, or a ConfigError naming the field that cannot be served."""
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if config.get(key):
            raise _field(where, key, config[key], "pagedserve serves weight quantization only")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _field(where, "quantization_status", status, "a compressed checkpoint is read")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _field(where, "config_groups", groups, "at least one weight scheme is needed")
    fallback = config.get("format")
    schemes = tuple(_scheme(where, name, g, fallback) for name, g in groups.items())
    return CompressedTensorsFormat(schemes, tuple(config.get("ignore") or ()))
