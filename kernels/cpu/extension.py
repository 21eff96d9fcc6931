"""Builds a C++ source in kernels/cpu into a Python module with torch's extension loader, when
first imported; the build is cached (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions),
so only the first start on a machine pays it (~30 s each).

Raises where no C++ compiler or ninja is found (the callers fall back to torch ops and say why).
Built for the host CPU (-march=native): the cache belongs to the machine that built it. Built
with -fopenmp, or at::parallel_for (a header template) would run every work item on one thread;
its OpenMP calls bind to the runtime torch has already loaded, so both share one thread pool.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from torch.utils.cpp_extension import load

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]


def build(source: str, name: str, extra_flags: tuple[str, ...] = ()) -> ModuleType:
    # torch's loader runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
    # which a virtual environment used without activating it does not put on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists() and bin_dir not in os.environ.get("PATH", "").split(
        os.pathsep
    ):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return load(
        name=name,
        sources=[str(Path(__file__).with_name(source))],
        extra_cflags=[*FLAGS, *extra_flags],
        verbose=False,
    )
