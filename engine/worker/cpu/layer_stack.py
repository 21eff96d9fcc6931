"""Runs every decoder layer of a Llama-shaped model on the CPU in one C++ call
(kernels/cpu/layer_stack.cpp) instead of a Python loop over the layers: the model's
`layers_runner`, installed here for the CPU attention backend.

Each layer's work is the same ops with the same operands as `PreNormLayer` with the fused CPU ops
and the CPU attention backend, so the hidden states are the same numbers; what goes away is the
per-op Python, which at a decode step's few rows cost as much as the arithmetic (profile and
numbers: measured 2026-11-24, round F in the git history of bench/README.md). Only for the models
and settings that path covers: a gated SiLU MLP, Llama's RMSNorm, one rotary table, no score
softcap, one rank; other models keep their layers.
"""

from __future__ import annotations

import torch

from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.layers.attention import ForwardContext
from engine.models.layers.linear import PackableLinear
from engine.models.layers.mlp import GatedMLP
from engine.models.llama import PreNormLayer
from kernels.kv_store import stored_rows


def _linear(name: str, layer: PackableLinear) -> dict[str, torch.Tensor | None]:
    if layer.quantized is not None:  # int8 or 4-bit: the C++ loop calls quant_linear
        return {
            f"{name}_weight": None,
            f"{name}_packed": layer.quantized.q,
            f"{name}_scales": layer.quantized.scales,
            f"{name}_mins": layer.quantized.mins,
            f"{name}_bias": layer.quantized_bias,
        }
    return {
        f"{name}_weight": layer.weight,
        f"{name}_packed": layer.packed,
        f"{name}_scales": None,
        f"{name}_mins": None,
        f"{name}_bias": layer.bias,
    }


def _stackable_layers(model: CausalLM) -> list[PreNormLayer] | str:
    """The model's layers when the C++ loop covers them all, else why not."""
    if not isinstance(model, DecoderModel):
        return "not a decoder model"
    if model.fused_ops is None:
        return "the fused CPU ops are not loaded"
    if model.shard.size > 1:
        return "tensor parallel"
    if any(rope != "default" for rope in model.rope_settings()):
        return "more than one rotary table"
    layers = []
    for layer in model.layers:
        if not isinstance(layer, PreNormLayer):
            return f"{type(layer).__name__} layers"
        if not isinstance(layer.mlp, GatedMLP) or layer.mlp.act_name != "silu":
            return "an MLP other than the gated SiLU one"
        options = layer.self_attn.options
        if options.softcap is not None or options.gemma_norm or options.rope != "default":
            return "attention scores capped or Gemma norms"
        layers.append(layer)
    return layers


class CpuLayerStack:
    def __init__(self, layers: list[PreNormLayer]) -> None:
        # Imported here, not with this module: both load C++ kernels, which the engine must be
        # importable without (kernels/cpu/extension.py); this class exists only where they load.
        from kernels.attention import cpu_backend
        from kernels.cpu.layer_stack import LAYER_TENSORS, LayerStack

        self.cpu_backend = cpu_backend
        self.layers = layers

        tensors: list[torch.Tensor | None] = []
        windows, plans = [], []
        int8_linears: list[bool] = []  # per layer: qkv, o, gate_up, down
        self.windows: list[int | None] = []  # each distinct window's plan index is its position
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, GatedMLP)
            window = attn.options.sliding_window
            if window not in self.windows:
                self.windows.append(window)
            windows.append(window or 0)
            plans.append(self.windows.index(window))
            qk_norm = attn.options.qk_norm
            parts = {
                "input_norm": layer.input_layernorm.weight,
                "q_norm": attn.q_norm.weight if qk_norm else None,
                "k_norm": attn.k_norm.weight if qk_norm else None,
                "post_norm": layer.post_attention_layernorm.weight,
                **_linear("qkv", attn.qkv_proj),
                **_linear("o", attn.o_proj),
                **_linear("gate_up", mlp.gate_up_proj),
                **_linear("down", mlp.down_proj),
            }
            tensors += [parts[name] for name in LAYER_TENSORS]
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            int8_linears += [linear.int8_activations for linear in linears]
        first = layers[0]
        self.stack = LayerStack(
            tensors,
            windows,
            plans,
            first.self_attn.num_heads,
            first.self_attn.num_kv_heads,
            first.self_attn.head_dim,
            first.input_layernorm.eps,
            first.self_attn.options.norm_eps,
            first.self_attn.scale,
            first.self_attn.qkv_proj.packed_own,
            int8_linears,
        )

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The last layer's output for embeddings `x`, storing each layer's K/V in its cache."""
        # The loop is the cpu backend's path: under another backend the Python layers run.
        if ctx.backend.name != "cpu":
            for layer in self.layers:
                x = layer(x, ctx)
            return x
        kv_caches, meta = ctx.kv_caches, ctx.meta
        k_cache = kv_caches[0][0]
        rows, slots = stored_rows(meta.slot_mapping)  # once a step, for every layer
        long = 0
        plans: list[list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]]
        if getattr(ctx.backend, "rows_alone", False):  # --batch-invariant
            meta, plans = self.cpu_backend.one_row_each(meta), [[] for _ in self.windows]
        elif self.cpu_backend.prefill_kernel_takes(x.dtype, k_cache.shape[-1], None):
            long, plans = self.cpu_backend.long_chunks(meta), [[] for _ in self.windows]
        else:
            plans = [
                [
                    (c.rows.start, c.rows.stop, c.slots, c.mask)
                    for c in self.cpu_backend.sdpa_chunks(
                        meta, k_cache.shape[1], x.dtype, x.device, window
                    )
                ]
                for window in self.windows
            ]
        cos, sin = ctx.rope["default"]
        return self.stack.forward(
            x,
            cos[:, 0],
            sin[:, 0],
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            rows,
            slots,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seqlens_k,
            self.cpu_backend.KERNEL_MAX_QUERY_LEN,
            plans,
            long,
            meta.num_reqs,
        )


def stack_cpu_layers(model: CausalLM) -> str | None:
    """Give `model` a C++ loop over its layers for the CPU attention backend. None when done,
    else why not (the model then runs its Python layers, as it does under other backends)."""
    layers = _stackable_layers(model)
    if isinstance(layers, str):
        return layers
    assert isinstance(model, DecoderModel)
    try:
        model.layers_runner = CpuLayerStack(layers)
    except ImportError as exc:  # not built, or not for this CPU
        return f"kernels.cpu.layer_stack does not load: {exc}"
    return None
