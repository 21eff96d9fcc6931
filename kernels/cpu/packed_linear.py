"""bfloat16 linear layers on the CPU with the weight reordered once, at load, into the blocked
layout oneDNN's matmul reads ("prepacked", what inductor's freezing pass does for constant
weights). F.linear reorders the weight on every call; at the few rows of a decode step that
reorder is most of the work: prepacked, 40 768x3072 linears at 16 rows take 9.8 ms instead of
17.8 (2 cores, AVX512-BF16; bench/README.md). The results are the same numbers F.linear gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's layout, for any number of rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    few_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one (then `weight` may be
    None), or for at most 16 rows through `few_rows`, the same weight packed for
    kernels/cpu/few_rows_linear when the model made one."""
    if packed is None:
        assert weight is not None, "a layer that was not packed keeps its weight"
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if few_rows is not None:
        from kernels.cpu import few_rows_linear  # loaded already: it made `few_rows`

        if rows.shape[0] <= few_rows_linear.MAX_ROWS:
            out = few_rows_linear.linear(rows, few_rows, bias, packed.shape[0])
            return out.view(*x.shape[:-1], out.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
