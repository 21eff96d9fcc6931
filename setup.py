"""Builds the C++ CPU kernels (kernels/cpu/*.cpp) into the package when it is built, so that no
installed copy needs a compiler at run time. Everything else about the package is in
pyproject.toml.

They compile against the torch in the build environment, and a C++ extension only loads under
the torch it was built against: build with `pip install --no-build-isolation` after installing
torch (the Makefile and the Dockerfile do). Under pip's default isolation the installed torch is
invisible; the package is then built without them (unless PAGEDSERVE_BUILD_KERNELS=1, which
makes that an error) and the kernels' callers take the torch ops, saying why.

PAGEDSERVE_CPU_ARCH names the target CPU (kernels/cpu/targets.py): `native` by default.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _targets() -> ModuleType:
    # By path: importing the `kernels` package here would import what the build does not have.
    spec = importlib.util.spec_from_file_location(
        "_pagedserve_targets", ROOT / "kernels/cpu/targets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


targets = _targets()


def _skip(why: str) -> dict[str, Any]:
    if os.environ.get(targets.BUILD_ENV) == "1":
        sys.exit(f"{targets.BUILD_ENV}=1 but the CPU kernels cannot be built: {why}")
    print(f"pagedserve: building without the CPU kernels ({why})", file=sys.stderr)
    return {}


def _kernel_build() -> dict[str, Any]:
    """setup()'s ext_modules and cmdclass for the kernels, or nothing where they are not built."""
    if os.environ.get(targets.BUILD_ENV) == "0":
        return {}
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return _skip(f"they are x86-64 code (AVX2/AVX512 intrinsics), this is {platform.machine()}")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return _skip("torch is not importable in the build environment: pip --no-build-isolation")
    import torch

    arch = targets.target_arch()

    # Each kernel is one source: ninja has nothing to run side by side within one, so the kernels
    # build in parallel instead (distutils' threads, one compiler process each), which needs the
    # plain backend, and torch's compiler-wrapper lookup off: its threads would wrap the compiler
    # command each other just set (`ccache ccache c++`).
    os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"

    class BuildKernels(BuildExtension.with_options(use_ninja=False)):  # type: ignore[misc]
        """torch's extension build, in parallel, plus the record the loader checks before it
        loads a kernel."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if self.parallel is None:
                self.parallel = os.cpu_count() or 1

        def build_extensions(self) -> None:
            super().build_extensions()
            compiler = self.compiler.compiler_so[0]
            macros = subprocess.run(
                [compiler, "-x", "c++", f"-march={arch}", "-dM", "-E", os.devnull],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            info = {
                "arch": arch,
                "cpu_features": targets.cpu_features_of(macros),
                "torch": torch.__version__,
                "sources": {
                    stem: targets.source_digest(targets.source_path(stem))
                    for stem in targets.KERNELS
                },
            }
            text = json.dumps(info, indent=1) + "\n"
            out_dir = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
            (out_dir / targets.BUILD_INFO).write_text(text)
            # An editable install copies the built modules into the checkout; the record with them.
            if getattr(self, "editable_mode", False):
                (ROOT / "kernels" / "cpu" / targets.BUILD_INFO).write_text(text)

    extensions = [
        CppExtension(
            name=f"kernels.cpu.{targets.module_name(stem)}",
            sources=[f"kernels/cpu/{stem}.cpp"],
            extra_compile_args=targets.compile_flags(stem, arch),
        )
        for stem in targets.KERNELS
    ]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": BuildKernels}}


setup(**_kernel_build())
