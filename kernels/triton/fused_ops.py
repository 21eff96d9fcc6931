"""A decoder layer's elementwise work on a CUDA GPU as fused Triton kernels, given to the model
as its `fused_ops` (engine/worker/gpu_fused_ops.py): RMSNorm, residual add + RMSNorm, SiLU(gate)
* up, and the q/k norm + rotary + K/V store that the attention layer runs before attention (the
backend then stores nothing). Each replaces several small torch kernels, which at small batches
cost more in launches (or CUDA graph nodes) than in memory traffic."""

from __future__ import annotations

from kernels.triton.rms_norm import add_rms_norm, rms_norm
from kernels.triton.rope_store_kv import rope_store_kv
from kernels.triton.silu_mul import silu_mul

__all__ = ["add_rms_norm", "rms_norm", "rope_store_kv", "silu_mul"]
