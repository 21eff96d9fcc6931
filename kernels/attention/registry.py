"""Every attention backend, one row each: its name, the KV block size it runs with unless told,
why it cannot run on a platform, and a factory that imports its kernel library only when used.
The table's order is `auto`'s order of preference; adding a backend is its file plus one row.

The order on a GPU is measured, not assumed (bench/RESULTS.md, H100, 2026-11-25): Triton served
the Qwen3-0.6B-shaped benchmark at 5,714 output tok/s, flash-attn 4 at 2,372 (no CUDA graphs: it
is not graph-safe, and it JIT-compiles each new shape mid-serving); flash-attn 4's eager decode
step was slower too up to batch 64 (47 vs 27 ms at batch 1). So `auto` takes Triton, flash-attn 4
runs only when named, and flash-attn 2 (never run here: no wheel for this torch) only where
Triton is missing."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention.backend import AttentionBackend
from kernels.attention.platform import Platform

CPU_KERNEL_MODULE = "kernels.cpu.paged_attention_op"  # imports when its C++ kernel loads
# flash-attn 4 ships only `flash_attn/cute/`, which makes `flash_attn` a namespace package that
# imports with flash-attn 2 absent: flash-attn 2 is there when its interface module is.
FA2_MODULE = "flash_attn.flash_attn_interface"
DEFAULT_BLOCK_SIZE = 16
FA2_BLOCK_SIZE = 256  # flash-attn 2's paged kernels need a multiple of 256
FA4_BLOCK_SIZE = 128  # flash-attn 4's fast path wants a page the size of its tile (128 on Hopper)
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    default_block_size: int
    auto_on: tuple[str, ...]  # the platform kinds ("cpu", "cuda") on which `auto` considers it
    unfit: Callable[[Platform, int | None], str | None]  # why not here (None: it can run)
    factory: Callable[[], AttentionBackend]


def _gpu_half_unfit(p: Platform) -> str | None:
    if p.capability is None:
        return f"it needs a CUDA device, not {p.device}"
    if p.dtype not in HALF:
        return (
            f"it takes float16 or bfloat16, not {str(p.dtype).removeprefix('torch.')} (see --dtype)"
        )
    return None


def _fa4_unfit(p: Platform, block_size: int | None) -> str | None:
    reason = _gpu_half_unfit(p)
    if reason is not None or p.capability is None:
        return reason
    if p.capability[0] not in (9, 10):
        return f"it runs on Hopper and Blackwell (compute capability 9.x, 10.x), this GPU has {p.capability[0]}.{p.capability[1]}"
    if p.head_dim > 256 or p.head_dim % 8:
        return f"head dim {p.head_dim} is not a multiple of 8 up to 256"
    return p.importable("flash_attn.cute")


def _fa2_unfit(p: Platform, block_size: int | None) -> str | None:
    reason = _gpu_half_unfit(p)
    if reason is not None or p.capability is None:
        return reason
    if p.capability < (8, 0):
        return f"it needs compute capability 8.0 or later, this GPU has {p.capability[0]}.{p.capability[1]}"
    if p.head_dim > 256 or p.head_dim % 8:
        return f"head dim {p.head_dim} is not a multiple of 8 up to 256"
    if block_size is not None and block_size % FA2_BLOCK_SIZE:
        return (
            f"its paged kernels need --block-size a multiple of {FA2_BLOCK_SIZE}, got {block_size}"
        )
    return p.importable(FA2_MODULE)


def _triton_unfit(p: Platform, block_size: int | None) -> str | None:
    reason = p.importable("triton")
    if reason is not None:
        return f"{reason} (pip install triton)"
    if p.capability is None and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it needs a CUDA device, not {p.device} (or TRITON_INTERPRET=1 to run its kernels on the CPU, slowly)"
    return None


def _cpu_unfit(p: Platform, block_size: int | None) -> str | None:
    if p.capability is not None:
        return f"it runs on the CPU, not {p.device}"
    return p.importable(CPU_KERNEL_MODULE)


def _flash_attn4() -> AttentionBackend:
    from kernels.attention.flash_attn4_backend import FlashAttn4Backend

    return FlashAttn4Backend()


def _flash_attn2() -> AttentionBackend:
    from kernels.attention.flash_attn_backend import FlashAttn2Backend

    return FlashAttn2Backend()


def _triton() -> AttentionBackend:
    from kernels.attention.triton_backend import TritonBackend

    return TritonBackend()


def _cpu() -> AttentionBackend:
    from kernels.attention.cpu_backend import CpuPagedBackend

    return CpuPagedBackend()


def _torch() -> AttentionBackend:
    from kernels.attention.torch_ref import TorchReferenceBackend

    return TorchReferenceBackend()


BACKENDS: tuple[BackendEntry, ...] = (
    # Triton runs on the CPU too (TRITON_INTERPRET=1), but only when named: it is slow there.
    BackendEntry("triton", DEFAULT_BLOCK_SIZE, ("cuda",), _triton_unfit, _triton),
    BackendEntry("flash-attn", FA2_BLOCK_SIZE, ("cuda",), _fa2_unfit, _flash_attn2),
    # Only when named: measured slower than Triton end to end (see above).
    BackendEntry("flash-attn-4", FA4_BLOCK_SIZE, (), _fa4_unfit, _flash_attn4),
    BackendEntry("cpu", DEFAULT_BLOCK_SIZE, ("cpu",), _cpu_unfit, _cpu),
    # The reference: runs anywhere, slowly; `auto` falls back to it when nothing above can run.
    BackendEntry("torch", DEFAULT_BLOCK_SIZE, (), lambda p, b: None, _torch),
)
REFERENCE = BACKENDS[-1]
BY_NAME = {entry.name: entry for entry in BACKENDS}
NAMES = tuple(BY_NAME)
