"""Gives a decoder on a CUDA GPU the fused Triton kernels (kernels/triton/fused_ops.py) as its
`fused_ops`: the layers then run their norms, residual adds, q/k norms + rotary + K/V store and
SiLU-mul as one kernel each instead of several torch ones (--no-fused-kernels: not given)."""

from __future__ import annotations

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM


def use_triton_fused_ops(model: CausalLM) -> str | None:
    """None when given, else why not: the layers then keep their torch ops."""
    if not isinstance(model, DecoderModel):
        return "not a decoder model"
    if model.embed_tokens.weight.device.type != "cuda":
        return "not on a CUDA device"
    try:
        from kernels.triton import fused_ops
    except ImportError as exc:  # triton missing or broken
        return f"kernels.triton.fused_ops does not load: {exc}"
    model.fused_ops = fused_ops
    return None
