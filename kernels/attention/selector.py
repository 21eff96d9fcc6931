"""Choose the attention backend and its KV block size at start-up, and say which and why.

`auto` takes the first that can run: on a GPU flash-attn 4 (Hopper and Blackwell), flash-attn 2
(Ampere and later), Triton (any CUDA GPU); on the CPU the C++ paged kernel (built on first use);
the torch reference (anywhere) when none of those can. The flash-attn
kernels take half-precision tensors only, and flash-attn 2's paged kernels want blocks of a
multiple of 256 tokens, so the block size is settled here too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from config import ConfigError
from kernels.attention.backend import AttentionBackend

NAMES = ("torch", "cpu", "triton", "flash-attn", "flash-attn-4")
CPU_KERNEL_MODULE = "kernels.cpu.paged_attention_op"  # importing it builds the kernel
DEFAULT_BLOCK_SIZE = 16
FA2_BLOCK_SIZE = 256  # flash-attn 2's paged kernels need a multiple of 256
FA4_BLOCK_SIZE = 128  # flash-attn 4's fast path wants a page the size of its tile (128 on Hopper)
HALF = (torch.float16, torch.bfloat16)


class BackendUnavailableError(ConfigError):
    """The backend asked for cannot run here (a bad setting: the command line exits 2)."""


@dataclass(frozen=True)
class AttentionChoice:
    name: str
    why: str
    block_size: int


@dataclass(frozen=True)
class Platform:
    """What the choice depends on, read once (tests pass their own)."""

    device: str
    dtype: torch.dtype
    head_dim: int
    capability: tuple[int, int] | None  # None: not a CUDA device
    importable: Callable[[str], str | None]  # module -> None if it imports, else why not

    @classmethod
    def detect(cls, device: str, dtype: torch.dtype, head_dim: int) -> Platform:
        capability = torch.cuda.get_device_capability(device) if device.startswith("cuda") else None
        return cls(device, dtype, head_dim, capability, import_error)


def import_error(module: str) -> str | None:
    """None when `module` imports, else the reason (a flash-attn build can be present but broken)."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed"
        importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a CUDA library missing under it
        return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unfit(name: str, p: Platform, block_size: int | None) -> str | None:
    """Why `name` cannot run on `p` with `block_size` (None: set by the backend), or None if it can."""
    if name == "torch":
        return None
    if name == "cpu":
        if p.capability is not None:
            return f"it runs on the CPU, not {p.device}"
        return p.importable(CPU_KERNEL_MODULE)
    if name == "triton":
        reason = p.importable("triton")
        if reason is not None:
            return f"{reason} (pip install triton)"
        if p.capability is None and not _interpreted():
            return f"it needs a CUDA device, not {p.device} (or TRITON_INTERPRET=1 to run its kernels on the CPU, slowly)"
        return None
    if p.capability is None:
        return f"it needs a CUDA device, not {p.device}"
    if p.dtype not in HALF:
        return (
            f"it takes float16 or bfloat16, not {str(p.dtype).removeprefix('torch.')} (see --dtype)"
        )
    if name == "flash-attn":
        if p.capability < (8, 0):
            return f"it needs compute capability 8.0 or later, this GPU has {p.capability[0]}.{p.capability[1]}"
        if p.head_dim > 256 or p.head_dim % 8:
            return f"head dim {p.head_dim} is not a multiple of 8 up to 256"
        if block_size is not None and block_size % FA2_BLOCK_SIZE:
            return f"its paged kernels need --block-size a multiple of {FA2_BLOCK_SIZE}, got {block_size}"
        return p.importable("flash_attn")
    # flash-attn-4
    if p.capability[0] not in (9, 10):
        return f"it runs on Hopper and Blackwell (compute capability 9.x, 10.x), this GPU has {p.capability[0]}.{p.capability[1]}"
    if p.head_dim > 256 or p.head_dim % 8:
        return f"head dim {p.head_dim} is not a multiple of 8 up to 256"
    return p.importable("flash_attn.cute")


def _block_size(name: str, requested: int | None) -> int:
    if requested is not None:
        return requested
    return {"flash-attn": FA2_BLOCK_SIZE, "flash-attn-4": FA4_BLOCK_SIZE}.get(
        name, DEFAULT_BLOCK_SIZE
    )


def choose(requested: str, platform: Platform, block_size: int | None = None) -> AttentionChoice:
    """The backend for `requested` (`auto` or a name) and the KV block size it runs with."""
    if requested != "auto":
        if requested not in NAMES:
            raise BackendUnavailableError(
                f"--attention-backend must be one of auto, {', '.join(NAMES)}; got {requested!r}"
            )
        reason = _unfit(requested, platform, block_size)
        if reason is not None:
            raise BackendUnavailableError(f"--attention-backend {requested}: {reason}")
        return AttentionChoice(
            requested, "forced by --attention-backend", _block_size(requested, block_size)
        )
    passed_over = []
    for name in (
        ("cpu",) if platform.capability is None else ("flash-attn-4", "flash-attn", "triton")
    ):
        reason = _unfit(name, platform, block_size)
        if reason is None:
            why = "the fastest that can run here" + (
                f" ({'; '.join(passed_over)})" if passed_over else ""
            )
            return AttentionChoice(name, why, _block_size(name, block_size))
        passed_over.append(f"not {name}: {reason}")
    return AttentionChoice(
        "torch",
        "the reference backend, slow (" + "; ".join(passed_over) + ")",
        _block_size("torch", block_size),
    )


def build_backend(name: str) -> AttentionBackend:
    """The backend called `name`; its kernel library is imported only here, when it is used."""
    if name == "triton":
        from kernels.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash-attn":
        from kernels.attention.flash_attn_backend import FlashAttn2Backend

        return FlashAttn2Backend()
    if name == "flash-attn-4":
        from kernels.attention.flash_attn4_backend import FlashAttn4Backend

        return FlashAttn4Backend()
    if name == "cpu":
        from kernels.attention.cpu_backend import CpuPagedBackend

        return CpuPagedBackend()
    from kernels.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()
