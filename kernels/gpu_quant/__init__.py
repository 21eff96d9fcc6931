"""Quantized linears for the GPU: FP8 weights and activations through `torch._scaled_mm`, and
4- or 8-bit weights with float32 group scales through a Triton kernel
(kernels/triton/quant_linear.py). `weights.to_gpu_weight` turns what a loader holds (a
QuantizedWeight, or a bf16 weight for FP8) into the form these run on."""
