"""Weight-only quantized linear for the GPU (W4A16, W8A16): x [m, k] in bf16/fp16 times a weight
stored as 4- or 8-bit integers with a float32 scale (and, optionally, a min) per output column
and group of input dims, summed in float32.

The weight's layout is kernels/triton/quant_layout.py's.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output, walking k in steps of BLOCK_K that
lie inside one group: it de-quantizes the step's [BLOCK_K, BLOCK_N] weights in float32
(q * scale + min, as QuantizedWeight.dequantize does), rounds them to x's dtype and multiplies
on the tensor cores with a float32 accumulator.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) the dot of two bf16 tiles is
wrong (numpy holds bf16 as raw 16-bit integers and multiplies those), so there the kernel widens
both tiles to float32 first: a product of two bf16 or fp16 values is exact in float32, so that
is the same sum as the tensor cores' bf16 x bf16 -> float32, up to the order of the adds."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch
from kernels.triton.quant_layout import PackedQuantWeight

TILE_K = (128, 64, 32, 16)  # BLOCK_K: the largest of these that divides the group


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    words_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BIAS_Q: tl.constexpr = 128 if BITS == 8 else 0
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_in = rm < M
    n_in = rn < N
    # The field of each k inside its word; the same for every step, as BLOCK_K % PER_WORD == 0.
    shifts = ((rk % PER_WORD) * BITS)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # This program's share of the k steps (all of them unless split).
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    for step in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, steps)):
        k0 = step * BLOCK_K
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_in[:, None], other=0.0)
        words = tl.load(
            words_ptr + (kk // PER_WORD)[:, None] * N + rn[None, :], mask=n_in[None, :], other=0
        )
        q = ((words >> shifts) & MASK) - BIAS_Q
        group = k0 // GROUP
        scales = tl.load(scales_ptr + group * N + rn, mask=n_in, other=0.0)
        w = q.to(tl.float32) * scales[None, :]
        if HAS_MINS:
            w = w + tl.load(mins_ptr + group * N + rn, mask=n_in, other=0.0)[None, :]
        w = w.to(x.dtype)
        if DOT_F32:  # the interpreter (module docstring): the same products, exact in float32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])
    else:  # float32 partial sums [SPLIT_K, M, N], added up (and the bias) after the kernel
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=m_in[:, None] & n_in[None, :])


# Programs a decode step's launch aims for: about one per SM of an H100 (132).
TARGET_PROGRAMS = 128
MAX_SPLIT_K = 16


def tiles(m: int, group: int) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K: a decode step's few rows take the smallest M tile tl.dot allows;
    BLOCK_K stays inside one group."""
    block_k = next(t for t in TILE_K if group % t == 0)
    if m <= 16:
        return 16, 64, block_k
    if m <= 64:
        return 64, 64, block_k
    return 128, 128, min(block_k, 64)


def split_k(m: int, n: int, k: int, group: int) -> int:
    """How many programs share one output tile's k steps. A decode step (a few rows) has one row
    of tiles along n: a 7B's down projection at 64 columns a tile is 64 programs, half an H100's
    SMs, each walking 14336 inputs. Splitting k fills the SMs; the partial sums cost a float32
    [split, m, n] buffer and one sum, small at these rows. Prefill has tiles enough."""
    block_m, block_n, block_k = tiles(m, group)
    if block_m > 16:
        return 1
    steps = k // block_k
    split = max(1, min(MAX_SPLIT_K, steps, triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, block_n))))
    # No program without a step: the same split of steps over fewer programs where it would.
    return triton.cdiv(steps, triton.cdiv(steps, split))


def quant_linear_output(x: torch.Tensor, weight: PackedQuantWeight) -> torch.Tensor:
    """What the kernel writes for x [m, k]: the output [m, n] in x's dtype, or float32 partial
    sums [split, m, n] (`split_k`)."""
    m = x.shape[0]
    split = split_k(m, weight.n, weight.k, weight.group)
    if split == 1:
        return torch.empty(m, weight.n, dtype=x.dtype, device=x.device)
    return torch.empty(split, m, weight.n, dtype=torch.float32, device=x.device)


def quant_linear_launch(
    x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> KernelLaunch:
    """The kernel's launch for x [m, k] (rows may be strided, columns contiguous) into `out`
    (`quant_linear_output`'s); also what the GPU compile test compiles."""
    m, k = x.shape
    split = split_k(m, weight.n, k, weight.group)
    assert k == weight.k and x.stride(1) == 1 and out.stride(-1) == 1
    assert out.dim() == (2 if split == 1 else 3) and out.is_contiguous()
    block_m, block_n, block_k = tiles(m, weight.group)
    dummy = weight.scales  # a pointer the kernel never reads (HAS_MINS / HAS_BIAS off)
    return KernelLaunch(
        kernel=_quant_linear_kernel,
        grid=(triton.cdiv(m, block_m), triton.cdiv(weight.n, block_n), split),
        args={
            "x_ptr": x,
            "words_ptr": weight.words,
            "scales_ptr": weight.scales,
            "mins_ptr": dummy if weight.mins is None else weight.mins,
            "bias_ptr": dummy if bias is None else bias,
            "out_ptr": out,
            "M": m,
            "N": weight.n,
            "K": k,
            "stride_xm": x.stride(0),
            "stride_om": out.stride(-2),
        },
        constexprs={
            "BITS": weight.bits,
            "GROUP": weight.group,
            "HAS_MINS": weight.mins is not None,
            "HAS_BIAS": bias is not None and split == 1,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "SPLIT_K": split,
            "DOT_F32": os.environ.get("TRITON_INTERPRET") == "1",
        },
        options={"num_warps": 4, "num_stages": 3},
    )


def quant_linear(
    x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., k] (bf16/fp16) @ the de-quantized weight.T (+ bias), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0:
        return torch.empty(*x.shape[:-1], weight.n, dtype=x.dtype, device=x.device)
    out = quant_linear_output(rows, weight)
    quant_linear_launch(rows, weight, bias, out).run()
    if out.dim() == 3:  # split k: the partial sums in float32, then the bias, as the kernel adds it
        summed = out.sum(dim=0)
        if bias is not None:
            summed += bias.to(torch.float32)
        out = summed.to(x.dtype)
    return out.view(*x.shape[:-1], weight.n)
