"""The model's settings, resolved once at start-up into a frozen `ModelSpec` that everything
below the engine reads: the weight loader, KV sizing, the runner, the CUDA graphs and the
tensor-parallel workers. Nothing below re-resolves a setting or looks inside a model's modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from config import ConfigError, EngineConfig
from engine.distributed.shard import Shard, check_shardable
from engine.loading.hub import tokenizer_path
from engine.loading.resolve import load_hf_config, resolve_device, resolve_dtype, resolve_model_path
from engine.models.interface import ArchitectureInfo
from engine.models.registry import describe, resolve_architecture
from kernels.attention import Platform, choose
from kernels.cpu.packed_linear import fixed_order_available

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    tokenizer_path: Path
    hf_config: PretrainedConfig
    architecture: str
    info: ArchitectureInfo
    device: str
    dtype: torch.dtype
    attention_backend: str
    block_size: int
    max_model_len: int
    tensor_parallel_size: int

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds (every rank the same number)."""
        return Shard(0, self.tensor_parallel_size).kv_heads(self.info.num_kv_heads)[1]

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on one rank, K and V of every layer."""
        return kv_bytes_per_block(self.info, self.block_size, self.dtype, self.tensor_parallel_size)


def kv_bytes_per_block(
    info: ArchitectureInfo, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1
) -> int:
    """Bytes of one KV block on one rank (each rank holds its own KV heads)."""
    _, kv_heads = Shard(0, tensor_parallel_size).kv_heads(info.num_kv_heads)
    per_token = 2 * info.num_layers * kv_heads * info.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def context_limit(hf_config: PretrainedConfig) -> int:
    """The longest context the model was trained for; sliding-window layers attend through
    their window, so a windowed model serves all of it."""
    return int(getattr(hf_config, "max_position_embeddings", 2048))


def resolve_model_spec(config: EngineConfig) -> ModelSpec:
    """Refuses what cannot run (architecture, rank count, backend, lengths) before anything is
    sized or started."""
    tp_size = config.parallel.tensor_parallel_size
    path = resolve_model_path(config.model)
    hf_config = load_hf_config(path)
    architecture = resolve_architecture(hf_config)
    info = describe(hf_config)
    check_shardable(info.divisible, info.num_kv_heads, tp_size)
    device = resolve_device(config.model.device)
    dtype, dtype_why = resolve_dtype(config.model.dtype, hf_config, torch.device(device))
    log.info("device %s, dtype %s (%s)", device, str(dtype).removeprefix("torch."), dtype_why)
    platform = Platform.detect(device, dtype, info.head_dim)
    choice = choose(config.model.attention_backend, platform, config.cache.block_size)
    log.info(
        "attention backend: %s, KV blocks of %d tokens (%s)",
        choice.name,
        choice.block_size,
        choice.why,
    )
    if config.model.batch_invariant:
        why_not = batch_invariance_unfit(device, dtype, choice.name)
        if why_not is not None:
            raise ConfigError(f"--batch-invariant: {why_not}")
        log.info(
            "batch-invariant: every row in a fixed order (linears and attention); prefill is slower"
        )
    return ModelSpec(
        path=path,
        tokenizer_path=path if config.model.tokenizer is None else tokenizer_path(config.model),
        hf_config=hf_config,
        architecture=architecture,
        info=info,
        device=device,
        dtype=dtype,
        attention_backend=choice.name,
        block_size=choice.block_size,
        max_model_len=config.resolve_max_model_len(context_limit(hf_config)),
        tensor_parallel_size=tp_size,
    )


def batch_invariance_unfit(device: str, dtype: torch.dtype, backend: str) -> str | None:
    """Why --batch-invariant cannot hold here, or None. It holds where every linear runs on
    kernels/cpu/bf16_linear and every attention row on the cpu backend's decode path, whose sums
    have one order whatever the batch; other kernels choose their blocking by the shape."""
    if device != "cpu":
        return f"it runs on the CPU, not {device}"
    if dtype != torch.bfloat16:
        return f"it runs in bfloat16 (--dtype bfloat16), not {str(dtype).removeprefix('torch.')}"
    if backend != "cpu":
        return f"it needs the cpu attention backend, not {backend}"
    if not fixed_order_available():
        return "its linear kernel (kernels/cpu/bf16_linear) needs a CPU with AVX512-BF16 and did not load here"
    return None
