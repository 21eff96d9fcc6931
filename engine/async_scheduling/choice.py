"""Whether steps run overlapped (--async-scheduling), and why not where they cannot."""

from __future__ import annotations

from config import ConfigError, EngineConfig
from engine.loading.model_spec import ModelSpec


def async_off_reason(config: EngineConfig, spec: ModelSpec) -> str | None:
    """Why this engine cannot overlap its steps; None when it can."""
    if spec.pooler is not None:
        return "a pooling model's steps sample nothing to overlap"
    if config.lora.enable_lora:
        return "LoRA adapters are loaded into their slots between steps (--enable-lora)"
    if spec.tensor_parallel_size > 1:
        return "tensor-parallel steps are not overlapped (--tensor-parallel-size)"
    if config.scheduler.speculative_config is not None:
        return "a step's drafts are proposed from the step before's tokens (--speculative-config)"
    if config.kv_offload.enabled:
        return "the KV offload tiers copy blocks between steps (--kv-offloading-*)"
    if spec.multimodal:
        return "a vision-language model's steps are not overlapped yet"
    return None


def use_async_scheduling(config: EngineConfig, spec: ModelSpec) -> bool:
    """--async-scheduling as asked (ConfigError where it cannot be); unset: on for CUDA, where
    the host's work per step is worth hiding, and off on the CPU, where the model's forward and
    the host's work share the same cores (bench/results/async-scheduling-2026-11-28.md)."""
    asked = config.scheduler.async_scheduling
    off = async_off_reason(config, spec)
    if asked and off is not None:
        raise ConfigError(f"--async-scheduling: {off}")
    if asked is not None:
        return asked
    return off is None and spec.device.startswith("cuda")
