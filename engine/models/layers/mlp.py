"""The gated MLP (down(act(gate(x)) * up(x))), its width split across tensor-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.models.layers.linear import ColumnParallelLinear, Part, RowParallelLinear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str, bias: bool, shard: Shard
    ) -> None:
        super().__init__()
        self.act_name, self.act = act, activation(act)
        column0, self.intermediate = shard.split(intermediate_size)
        # `offset`: where up starts in a checkpoint that fuses gate and up (Phi-3).
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size,
            [
                Part("gate", column0, self.intermediate, intermediate_size),
                Part("up", column0, self.intermediate, intermediate_size, offset=intermediate_size),
            ],
            bias,
        )
        self.down_proj = RowParallelLinear(column0, self.intermediate, hidden_size, bias, shard)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused is not None and self.act_name == "silu":
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
