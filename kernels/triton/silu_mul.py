"""The gated MLP's activation, silu(gate) * up, read from the fused gate_up projection's output
in one pass, rounded where the torch ops round (silu's result to the activations' dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import KernelLaunch

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,  # between tokens; the gate columns come first, then as many up columns
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    row = gate_up_ptr + token * stride_gate_up
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + WIDTH + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * WIDTH + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_launch(gate_up: torch.Tensor, out: torch.Tensor) -> KernelLaunch:
    """The launch for gate_up [tokens, 2 * width] (rows may be strided) into out [tokens, width]
    contiguous; also read by the GPU compile test."""
    tokens, columns = gate_up.shape
    width = columns // 2
    assert gate_up.stride(1) == 1 and out.is_contiguous() and columns == 2 * width
    block = min(BLOCK, triton.next_power_of_2(width))
    return KernelLaunch(
        kernel=_silu_mul_kernel,
        grid=(tokens, triton.cdiv(width, block)),
        args={"gate_up_ptr": gate_up, "out_ptr": out, "stride_gate_up": gate_up.stride(0)},
        constexprs={"WIDTH": width, "BLOCK": block},
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * width] with the gate columns first."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty(
        (rows.shape[0], rows.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device
    )
    if rows.shape[0]:
        silu_mul_launch(rows, out).run()
    return out.view(*gate_up.shape[:-1], out.shape[-1])
