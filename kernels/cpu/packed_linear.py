"""bfloat16 linear layers on the CPU with the weight reordered once, at load, into the layout
the fastest kernel here reads: kernels/cpu/bf16_linear's on CPUs with AVX512-BF16 and no AMX,
else the blocked layout oneDNN's matmul reads ("prepacked", what inductor's freezing pass does
for constant weights). F.linear reorders the weight on every call; at the few rows of a decode
step that reorder is most of the work: prepacked, 40 768x3072 linears at 16 rows take 9.8 ms
instead of 17.8 (2 cores, AVX512-BF16; measured 2026-11-23, commit 89613d9). oneDNN gives the
numbers F.linear gives; bf16_linear the same up to the order of its float32 sums.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def own_layout() -> bool:
    """Whether weights are packed for kernels/cpu/bf16_linear here unless told: where it loads
    and is preferred over oneDNN (AVX512-BF16 without AMX)."""
    try:
        from kernels.cpu import bf16_linear
    except ImportError:  # not built, or not for this CPU (extension.py logs why): oneDNN it is
        return False
    return bf16_linear.PREFERRED


@functools.cache
def fixed_order_available() -> bool:
    """Whether kernels/cpu/bf16_linear runs here. Each output row of it is its own float32 sum
    over the inputs in one order whatever the row count, so a row's numbers do not depend on
    the rows beside it (oneDNN picks its blocking, and so its sums' order, by the shape)."""
    try:
        from kernels.cpu import bf16_linear
    except ImportError:
        return False
    return bf16_linear.AVAILABLE


def can_pack(weight: torch.Tensor, own: bool | None = None) -> bool:
    """`own`: for kernels/cpu/bf16_linear (None: this CPU's preference, `own_layout()`)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if own_layout() if own is None else own:
        from kernels.cpu import bf16_linear

        return bf16_linear.can_pack(weight)
    return torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor, own: bool | None = None) -> torch.Tensor:
    """The weight [out, in] in the layout `linear` reads here, for any number of rows; `own` as
    in `can_pack`."""
    if own_layout() if own is None else own:
        from kernels.cpu import bf16_linear

        return bf16_linear.pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    own: bool | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one (then `weight` may be
    None); `own`: the layout `pack` was asked for."""
    if packed is None:
        assert weight is not None, "a layer that was not packed keeps its weight"
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if own_layout() if own is None else own:
        from kernels.cpu import bf16_linear

        out = bf16_linear.linear(rows, packed, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])
