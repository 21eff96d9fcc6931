"""GPTQ and AWQ checkpoints (`quant_method: gptq` / `awq`) read for the CPU's quantized kernel.
Both store unsigned integers packed into int32 words (value i of a word in bits 4i.., or 8i..),
float16 `scales` [groups, out] and packed zero points `qzeros` [groups, out / per word]; a weight
is (q - zero) * scale. The kernel's is q' * scale + min: 4-bit weights keep q with
min = -zero * scale; 8-bit ones q - 128 (its int8) with min = (128 - zero) * scale. Exact in
float32 with float16 scales.

- GPTQ: `qweight` [in / per word, out], packed along the input dim. Its original format
  (`checkpoint_format: gptq`) stores each zero point less one; `gptq_v2` stores it as is.
  With `desc_act` the groups follow the activation order through `g_idx`: served when `g_idx`
  is in input order after all (every input's group is its index // group size), refused
  otherwise, since the kernel's groups are runs of consecutive inputs.
- AWQ (`version: gemm`, 4-bit, zero points): `qweight` [in, out / 8], packed along the output
  dim, each word holding its eight columns in the order 0, 2, 4, 6, 1, 3, 5, 7."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from config import ConfigError
from engine.errors import ModelLoadError
from engine.loading.int_packing import unpack_words
from engine.loading.linear_format import Tensors, check_shape, group_count
from kernels.cpu.quant_layout import QuantizedWeight

# Which of a word's eight 4-bit slots holds column j of its eight (AWQ's gemm packing).
AWQ_SLOT_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]


@dataclass(frozen=True)
class IntGroupFormat:
    method: str  # gptq or awq
    bits: int
    group_size: int  # -1: one group a row
    zero_offset: int  # added to each stored zero point (1 for GPTQ's original format)
    skip: tuple[str, ...]  # layers left dense (AWQ's modules_to_not_convert, GPTQ's head)

    def describe(self) -> str:
        group = "per row" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"{self.method} int{self.bits}, {group}: integers read as stored"

    def stores_quantized(self, prefix: str, names: set[str]) -> bool:
        return "qweight" in names

    def expects_quantized(self, prefix: str) -> bool:
        # A substring of the layer's name, as AutoAWQ matches modules_to_not_convert.
        return not any(s in prefix for s in self.skip)

    def read(self, prefix: str, tensors: Tensors) -> QuantizedWeight | torch.Tensor:
        packed = tensors("qweight")
        per_word = 32 // self.bits
        if self.method == "gptq":
            q = unpack_words(packed, self.bits, dim=0).t()  # [out, in]
        else:
            q = unpack_words(packed, self.bits, dim=1)
            q = _awq_columns(q).t()
        n, k = q.shape
        groups = group_count(k, self.group_size, f"{prefix}.qweight")
        expected = (k // per_word, n) if self.method == "gptq" else (k, n // per_word)
        check_shape(packed, expected, f"{prefix}.qweight")
        scales = tensors("scales")
        check_shape(scales, (groups, n), f"{prefix}.scales")
        qzeros = tensors("qzeros")
        check_shape(qzeros, (groups, n // per_word), f"{prefix}.qzeros")
        zeros = unpack_words(qzeros, self.bits, dim=1)
        if self.method == "awq":
            zeros = _awq_columns(zeros)
        if self.method == "gptq":
            _check_g_idx(prefix, tensors, k, self.group_size)
        s = scales.to(torch.float32).t().contiguous()
        z = (zeros + self.zero_offset).to(torch.float32).t()
        if self.bits == 4:
            return QuantizedWeight(q.to(torch.int8).contiguous(), s, (-z * s).contiguous(), bits=4)
        mid = 1 << (self.bits - 1)  # int8 holds q - 128; the min puts the 128 back
        return QuantizedWeight(
            (q - mid).to(torch.int8).contiguous(), s, ((mid - z) * s).contiguous(), bits=8
        )


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Columns in the order AWQ's words hold them -> in order."""
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[..., AWQ_SLOT_OF_COLUMN].reshape(rows, cols)


def _check_g_idx(prefix: str, tensors: Tensors, k: int, group_size: int) -> None:
    try:
        g_idx = tensors("g_idx")
    except ModelLoadError:
        return  # no g_idx: groups in input order
    in_order = torch.arange(k) // (k if group_size == -1 else group_size)
    if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), in_order):
        raise ModelLoadError(
            f"tensor {prefix}.g_idx puts inputs in groups out of their order (desc_act): "
            "pagedserve's kernel reads groups of consecutive inputs; quantize without "
            "desc_act, or with static groups"
        )


def _field(where: str, key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"{where}: quantization_config.{key} is {value!r}; {why}")


def parse_gptq_awq(config: dict[str, Any], where: str) -> IntGroupFormat:
    """GPTQ's or AWQ's settings, or a ConfigError naming the field that cannot be served."""
    method = config["quant_method"]
    bits = config.get("bits", config.get("w_bit"))
    allowed = (4, 8) if method == "gptq" else (4,)
    if not isinstance(bits, int) or bits not in allowed:
        raise _field(where, "bits", bits, f"{method} is read with {allowed} bits")
    group = config.get("group_size", config.get("q_group_size", -1))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise _field(where, "group_size", group, "a positive size, or -1 for whole rows")
    skip: tuple[str, ...]
    if method == "gptq":
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _field(where, "checkpoint_format", fmt, "gptq or gptq_v2")
        if config.get("dynamic"):
            raise _field(where, "dynamic", config["dynamic"], "one setting for every layer")
        offset = 1 if fmt == "gptq" else 0
        skip = () if config.get("lm_head") else ("lm_head",)
    else:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _field(where, "version", version, "the gemm packing is read")
        if config.get("zero_point", True) is not True:
            raise _field(where, "zero_point", config["zero_point"], "zero points are read")
        offset = 0
        skip = ("lm_head", *(config.get("modules_to_not_convert") or ()))
    return IntGroupFormat(method, bits, group, offset, skip)
