"""What the choice of attention backend depends on, read once at start-up."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """The device, dtype and head dim the model runs with (tests pass their own)."""

    device: str
    dtype: torch.dtype
    head_dim: int
    capability: tuple[int, int] | None  # None: not a CUDA device
    importable: Callable[[str], str | None]  # module -> None if it imports, else why not

    @classmethod
    def detect(cls, device: str, dtype: torch.dtype, head_dim: int) -> Platform:
        capability = torch.cuda.get_device_capability(device) if device.startswith("cuda") else None
        return cls(device, dtype, head_dim, capability, import_error)

    @property
    def kind(self) -> str:
        """ "cuda" or "cpu": which backends `auto` considers."""
        return "cpu" if self.capability is None else "cuda"


def import_error(module: str) -> str | None:
    """None when `module` imports, else the reason (a flash-attn build can be present but broken)."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed"
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a CUDA library missing under it
        return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None
