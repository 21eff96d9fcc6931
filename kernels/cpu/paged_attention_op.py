"""The CPU paged-attention kernel (paged_attention.cpp), compiled when this module is first
imported and cached by torch's extension loader (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions), so only the first start on a machine pays the build (~30 s).

Importing fails (and the backend selector says why) where no C++ compiler or ninja is found.
Built for the host CPU (-march=native): the cache belongs to the machine that built it. Built
with -fopenmp, or at::parallel_for (a header template) would run every work item on one thread;
its OpenMP calls bind to the runtime torch has already loaded, so both share one thread pool.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

_SOURCE = Path(__file__).with_name("paged_attention.cpp")

# torch's loader runs `ninja` from PATH; the pip-installed one sits beside this interpreter,
# which a virtual environment used without activating it does not put on PATH.
_BIN = str(Path(sys.executable).parent)
if (Path(_BIN) / "ninja").exists() and _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

_module = load(
    name="pagedserve_cpu_paged_attention",
    sources=[str(_SOURCE)],
    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
    verbose=False,
)


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    scale: float,
    max_query_len: int = 2**31 - 1,
) -> None:
    """Writes into `out` [tokens, heads, dim] the causal attention of every query row of `q`
    over its request's cached keys (all contiguous; tables and lengths int32). The rows of
    requests with more than `max_query_len` query rows are not written."""
    _module.paged_attention(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale, max_query_len)
