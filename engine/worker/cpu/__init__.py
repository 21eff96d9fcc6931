"""The CPU path of the worker: what a loaded model is given to run faster on the CPU (weights
prepacked for the bfloat16 kernel, the fused elementwise ops, all decoder layers in one C++
call). The model only uses what it is given; which of these apply here, and why not, is decided
here."""

from engine.worker.cpu.prepare import fuse_ops, pack_weights, prepare_model

__all__ = ["fuse_ops", "pack_weights", "prepare_model"]
