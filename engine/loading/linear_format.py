"""What a quantized checkpoint format (compressed-tensors, GPTQ, AWQ) tells the loader about its
linear layers: which of them it stores quantized, and how one layer's tensors become the
quantized kernel's integers, scales and mins (or an FP8 layer, engine/loading/fp8_layers.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.errors import ModelLoadError
from engine.loading.fp8_layers import Fp8Layer
from kernels.cpu.quant_layout import QuantizedWeight

# A layer's tensor by its name after the layer's prefix ("qweight", "weight_scale", ...);
# a ModelLoadError naming the file and the tensor when the checkpoint lacks it.
Tensors = Callable[[str], torch.Tensor]


class LinearFormat(Protocol):
    @property
    def method(self) -> str:
        """quant_method in config.json, also --quantization's name for it."""
        ...

    def describe(self) -> str:
        """A line for the log: the format and its settings."""
        ...

    def stores_quantized(self, prefix: str, names: set[str]) -> bool:
        """Whether the layer at `prefix`, whose checkpoint tensors are `names`, is quantized."""
        ...

    def expects_quantized(self, prefix: str) -> bool:
        """Whether the config says the linear at `prefix` is quantized (a dense weight for it is
        then a checkpoint that lies)."""
        ...

    def read(self, prefix: str, tensors: Tensors) -> QuantizedWeight | Fp8Layer | torch.Tensor:
        """The layer's weight [out, in]: integers for the kernel, an FP8 layer (read when the
        loader asks), or a dense float tensor."""
        ...


def check_shape(tensor: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(
            f"tensor {what} is {tuple(tensor.shape)}, its layer's settings need {expected}"
        )


def group_count(in_features: int, group: int | None, what: str) -> int:
    """Groups of `group` input features in a row (None or -1: one group, the whole row)."""
    if group is None or group == -1:
        return 1
    if group <= 0 or in_features % group or group % 2:
        raise ModelLoadError(
            f"{what}: a group size of {group} does not split {in_features} input features into "
            "whole groups of an even size"
        )
    return in_features // group
