"""One launch of a Triton kernel as data: its grid, runtime arguments, constexprs and options.

Each kernel's launch code builds one of these from its tensors and runs it; the compile test
(tests/kernels/attention/test_triton_compile.py) builds the same description from meta tensors and compiles it
for real GPU targets. The tile choice and the argument list then live in one place, so what
the test compiles is what a GPU would run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a @triton.jit function (an interpreted one under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: Mapping[str, object]  # runtime arguments by parameter name: tensors, ints, floats
    constexprs: Mapping[str, int | str]  # compile-time parameters: tiles, shapes, precision
    # Compile options such as num_warps and num_stages; empty: Triton's defaults.
    options: Mapping[str, int] = field(default_factory=dict)

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.constexprs, **self.options)
