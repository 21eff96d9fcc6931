"""Loads a C++ CPU kernel: the module built with the package (setup.py), after checking that this
CPU has every instruction-set feature the build's target let the compiler use and that torch is
the one it was built against. Loading compiles nothing.

Only in a source checkout (an editable install, or the tree on sys.path) is a kernel compiled at
run time, with torch's extension loader, as a development fallback: when it was never built here,
or its C++ changed since it was (cached in TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions). An installed package never compiles.

Where a kernel cannot load, `load` raises KernelUnavailable (an ImportError, which every caller
catches and answers with the torch ops) and logs why, once per kernel.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu import targets

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
CPUINFO = Path("/proc/cpuinfo")


class KernelUnavailable(ImportError):
    """A kernel that cannot run here; the message says why."""


@dataclass(frozen=True)
class BuildInfo:
    arch: str
    cpu_features: tuple[str, ...]
    torch: str
    sources: dict[str, str]  # kernel stem -> sha256 of the C++ it was built from

    @classmethod
    def read(cls, path: Path) -> BuildInfo | None:
        try:
            data = json.loads(path.read_text())
            return cls(
                str(data["arch"]),
                tuple(data["cpu_features"]),
                str(data["torch"]),
                dict(data["sources"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


@functools.cache
def cpu_features() -> frozenset[str] | None:
    """This CPU's feature flags as Linux names them; None where that cannot be read."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def source_checkout() -> bool:
    """Whether the package runs from its source tree (pyproject.toml beside the packages), where a
    developer may change a kernel's C++ between installs; an installed package has no such file."""
    return (PACKAGE_DIR.parent.parent / "pyproject.toml").is_file()


def why_not_loadable(
    info: BuildInfo, features: frozenset[str] | None, torch_version: str
) -> str | None:
    """None when a module built as `info` says can run on a CPU with `features` under torch
    `torch_version`, else why not."""
    if torch_version != info.torch:
        return (
            f"built against torch {info.torch}, this is torch {torch_version}: reinstall pagedserve"
        )
    if features is not None:
        missing = sorted(set(info.cpu_features) - features)
        if missing:
            return (
                f"built for -march={info.arch}, which uses {', '.join(missing)}: this CPU lacks them"
                f" (install on this machine with {targets.ARCH_ENV}=native, or name an older target)"
            )
    return None


def _changed_since_built(stem: str, info: BuildInfo) -> bool:
    source = targets.source_path(stem)
    return source.is_file() and targets.source_digest(source) != info.sources.get(stem)


def _prebuilt(stem: str) -> ModuleType:
    name = f"kernels.cpu.{targets.module_name(stem)}"
    if importlib.util.find_spec(name) is None:
        raise KernelUnavailable("it was not built when pagedserve was installed")
    info = BuildInfo.read(PACKAGE_DIR / targets.BUILD_INFO)
    if info is None:
        raise KernelUnavailable(f"its build record ({targets.BUILD_INFO}) is missing or unreadable")
    if source_checkout() and _changed_since_built(stem, info):
        raise KernelUnavailable(f"{stem}.cpp changed since it was built")
    reason = why_not_loadable(info, cpu_features(), torch.__version__)
    if reason is not None:
        raise KernelUnavailable(reason)
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a missing symbol, an operator registered twice: never a crash
        raise KernelUnavailable(
            f"the built module does not load: {type(exc).__name__}: {exc}"
        ) from exc


def _compile_here(stem: str) -> ModuleType:
    """The development fallback: compile the kernel now, for this machine."""
    from torch.utils.cpp_extension import load as jit_load

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) to build it with")
    # torch's loader runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
    # which a virtual environment used without activating it does not put on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and bin_dir not in os.environ.get("PATH", "").split(
        os.pathsep
    ):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        return jit_load(
            name=f"pagedserve_cpu_{stem}",
            sources=[str(targets.source_path(stem))],
            extra_cflags=targets.compile_flags(stem, targets.target_arch()),
            verbose=False,
        )
    except Exception as exc:  # a compiler error, a missing ninja, a failed load
        raise KernelUnavailable(f"building it here failed: {type(exc).__name__}: {exc}") from exc


_loaded: dict[str, ModuleType] = {}
_unavailable: dict[str, str] = {}  # stem -> why; said once, however often the wrappers import


def load(stem: str) -> ModuleType:
    """kernels/cpu/<stem>.cpp as a module, or KernelUnavailable (logged once) saying why not."""
    if stem in _unavailable:
        raise KernelUnavailable(_unavailable[stem])
    if stem not in _loaded:
        try:
            _loaded[stem] = _load(stem)
        except KernelUnavailable as exc:
            _unavailable[stem] = str(exc)
            raise
    return _loaded[stem]


def _load(stem: str) -> ModuleType:
    try:
        return _prebuilt(stem)
    except KernelUnavailable as prebuilt_failed:
        why = f"{prebuilt_failed}"
        if source_checkout() and targets.source_path(stem).is_file():
            log.info("CPU kernel %s: %s; building it from source (a checkout)", stem, why)
            try:
                return _compile_here(stem)
            except KernelUnavailable as build_failed:
                why = f"{why}, and {build_failed}"
        log.warning("CPU kernel %s unavailable, torch ops run instead: %s", stem, why)
        raise KernelUnavailable(f"CPU kernel {stem}: {why}") from None
