"""Runs the model on one device: owns the weights and the paged KV cache of every layer.

The runner sees only `ModelInput` (tensors and block tables), never the scheduler, so more
ranks can each run their own runner on the same input.
"""

from __future__ import annotations

import logging

import torch

from config import EngineConfig
from engine.model_input import ModelInput
from engine.model_loader import LoadedModel, load_model
from engine.models.llama import LlamaForCausalLM, head_dim_of
from engine.parallel.shard import Shard
from kernels.attention import AttentionBackend, select_attention_backend
from kernels.kv_store import copy_blocks

log = logging.getLogger(__name__)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of one KV block on one rank (each rank holds its own KV heads)."""
    _, kv_heads = Shard(0, tensor_parallel_size).kv_heads(hf_config.num_key_value_heads)
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim_of(hf_config)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.backend = backend
        cfg = model.config
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        model.init_rotary(max_model_len)
        shape = (num_blocks, block_size, model.layers[0].self_attn.num_kv_heads, head_dim_of(cfg))
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        gib = kv_bytes_per_block(cfg, block_size, self.dtype, model.shard.size) * num_blocks / 2**30
        if model.shard.rank == 0:
            per_rank = " per rank" if model.shard.size > 1 else ""
            log.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB%s", num_blocks, block_size,
                     num_blocks * block_size, gib, per_rank)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor | None:
        """Logits (float32) of the rows in `inp.logits_indices` (None on ranks other than 0)."""
        copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], inp.block_copies)
        hidden = self.model(inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn)
        return self.model.compute_logits(hidden.index_select(0, inp.logits_indices))


def build_runner(config: EngineConfig, shard: Shard, num_blocks: int, max_model_len: int) -> tuple[LoadedModel, ModelRunner]:
    """This rank's shard of the model and its runner (one GPU per rank on CUDA)."""
    device = config.model.device
    if shard.size > 1 and device.startswith("cuda"):
        config = config.model_copy(update={"model": config.model.model_copy(update={"device": f"cuda:{shard.rank}"})})
    loaded = load_model(config.model, shard)
    backend = select_attention_backend(config.model.attention_backend, config.model.device)
    return loaded, ModelRunner(loaded.model, backend, num_blocks, config.cache.block_size, max_model_len)
