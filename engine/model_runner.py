"""Runs the model on one device: owns the weights and the paged KV cache of every layer.

The runner sees only `ModelInput` (tensors and block tables), never the scheduler, so more
ranks can each run their own runner on the same input.
"""

from __future__ import annotations

import logging

import torch

from engine.model_input import ModelInput
from engine.models.llama import LlamaForCausalLM, head_dim_of
from kernels.attention import AttentionBackend
from kernels.kv_store import copy_blocks

log = logging.getLogger(__name__)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim_of(hf_config)
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
        shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim_of(cfg))
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        gib = kv_bytes_per_block(cfg, block_size, self.dtype) * num_blocks / 2**30
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB", num_blocks, block_size, num_blocks * block_size, gib)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Logits (float32) of the rows in `inp.logits_indices`."""
        copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], inp.block_copies)
        hidden = self.model(inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn)
        return self.model.compute_logits(hidden.index_select(0, inp.logits_indices))
