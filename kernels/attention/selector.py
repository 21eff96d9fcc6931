"""Choose the attention backend and its KV block size at start-up, and say which and why.

`auto` takes the first row of the backend table (`registry.BACKENDS`) that can run: on a GPU
Triton (measured fastest on an H100, see the registry), then flash-attn 2 (Ampere and later);
on the CPU the C++ paged kernel (built when the package is installed); the torch reference
(anywhere) when none of those can. flash-attn 4 runs when named. The flash-attn kernels take
half-precision tensors only, and flash-attn 2's paged kernels want blocks of a multiple of 256
tokens, so the block size is settled here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from config import ConfigError
from kernels.attention.backend import AttentionBackend
from kernels.attention.platform import Platform
from kernels.attention.registry import BACKENDS, BY_NAME, NAMES, REFERENCE, BackendEntry


class BackendUnavailableError(ConfigError):
    """The backend asked for cannot run here (a bad setting: the command line exits 2)."""


@dataclass(frozen=True)
class AttentionChoice:
    name: str
    why: str
    block_size: int


def _or_default(block_size: int | None, entry: BackendEntry) -> int:
    return entry.default_block_size if block_size is None else block_size


def choose(requested: str, platform: Platform, block_size: int | None = None) -> AttentionChoice:
    """The backend for `requested` (`auto` or a name) and the KV block size it runs with
    (`block_size` when given, else the backend's own)."""
    if requested != "auto":
        entry = BY_NAME.get(requested)
        if entry is None:
            raise BackendUnavailableError(
                f"--attention-backend must be one of auto, {', '.join(NAMES)}; got {requested!r}"
            )
        reason = entry.unfit(platform, block_size)
        if reason is not None:
            raise BackendUnavailableError(f"--attention-backend {requested}: {reason}")
        return AttentionChoice(
            requested, "forced by --attention-backend", _or_default(block_size, entry)
        )
    passed_over: list[str] = []
    for entry in BACKENDS:
        if platform.kind not in entry.auto_on:
            continue
        reason = entry.unfit(platform, block_size)
        if reason is None:
            why = "the fastest that can run here" + (
                f" ({'; '.join(passed_over)})" if passed_over else ""
            )
            return AttentionChoice(entry.name, why, _or_default(block_size, entry))
        passed_over.append(f"not {entry.name}: {reason}")
    return AttentionChoice(
        REFERENCE.name,
        "the reference backend, slow (" + "; ".join(passed_over) + ")",
        _or_default(block_size, REFERENCE),
    )


def build_backend(name: str, rows_alone: bool = False) -> AttentionBackend:
    """The backend called `name`; its kernel library is imported only here, when it is used.
    `rows_alone`: every query row attended to on its own, in an order that does not depend on
    the batch (--batch-invariant; the cpu backend's alone, which the caller has checked)."""
    if rows_alone:
        if name != "cpu":
            raise ValueError(f"only the cpu attention backend attends row by row, not {name}")
        from kernels.attention.cpu_backend import CpuPagedBackend

        return CpuPagedBackend(rows_alone=True)
    return BY_NAME[name].factory()
