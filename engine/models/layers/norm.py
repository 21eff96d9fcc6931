"""RMSNorm, in Llama's form (`w * x`) and Gemma's (`(1 + w) * x`, computed in float32)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Gemma stores the scale less one and multiplies before casting back: the fused CPU op
        # does neither, so Gemma's norms always take the torch path.
        self.gemma = gemma

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        if self.gemma:
            normed = x.float()
            normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, fused: ModuleType | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x)."""
        if fused is not None and not self.gemma:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual, fused), residual
