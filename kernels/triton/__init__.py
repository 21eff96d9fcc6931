"""Triton kernels: the GPU backend when flash-attn is not installed. On a CPU they run under
Triton's interpreter (TRITON_INTERPRET=1), which is how CI checks them against the torch
reference."""
