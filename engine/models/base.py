"""What every decoder-only model here shares: the vocab-parallel embedding, a stack of decoder
layers, the final norm and the LM head; rotary tables; loading by Hugging Face names. An
architecture file subclasses `DecoderModel` with its layer (`build_layer`) and the few switches
below.

How a platform runs the model faster is not the model's business: after loading, the worker may
give it prepacked weights, fused elementwise ops and a `layers_runner` that replaces the Python
loop over its layers (engine/worker/cpu/ does, on the CPU); the model only uses what it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import ClassVar, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.distributed.shard import WHOLE, Shard, gather_columns
from engine.models.interface import ArchitectureInfo
from engine.models.layers.attention import Attention, AttentionOptions, ForwardContext
from engine.models.layers.linear import (
    CheckpointTensor,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from engine.models.layers.lora import LoRAStep
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.weights import load_checkpoint
from engine.multimodal.inputs import MultiModalStep
from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.cpu import weight_only
from kernels.cpu.packed_linear import linear
from kernels.cpu.quant_layout import PackedWeight

# Checkpoint module names fused into one of ours: name -> (our name, part).
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LayersRunner(Protocol):
    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The last decoder layer's output for the embeddings `x`, each layer's K/V stored in
        its cache: what the model's layers called in order give."""
        ...


def head_dim_of(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_windows(cfg: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's window: from `layer_types` where the config has them (Gemma, Qwen2/3), else
    every layer's when a window is set and not switched off (Mistral, Mixtral, Phi-3)."""
    window = getattr(cfg, "sliding_window", None)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types[:n])
    if window and getattr(cfg, "use_sliding_window", True):
        return (int(window),) * n
    return (None,) * n


class DecoderModel(nn.Module):
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = FUSED_QKV_GATE_UP
    gemma_norm: ClassVar[bool] = False  # the final norm in Gemma's (1 + w) form
    # Multimodal rotary (Qwen2-VL): the rotated pairs' split over (time, height, width).
    mrope_section: tuple[int, ...] | None = None

    def __init__(self, cfg: PretrainedConfig, shard: Shard = WHOLE) -> None:
        super().__init__()
        self.config, self.shard = cfg, shard
        self.info = self.describe(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(self.build_layer(i) for i in range(self.info.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=self.gemma_norm)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.hidden_size, self.embed_tokens)
        self.rotary: dict[str, RotaryEmbedding] = {}
        # What a platform may give the model after loading (engine/worker/cpu/ on the CPU):
        self.lm_head_packed: torch.Tensor | None = None  # the tied head, prepacked
        self.lm_head_packed_own = False  # in kernels/cpu/bf16_linear's layout (else oneDNN's)
        self.lm_head_quantized: PackedWeight | None = None  # the tied head, quantized
        self.lm_head_int8_activations = False  # it takes int8 activations (see linear.py)
        self.fused_ops: ModuleType | None = None  # the layers' norms, rotary and SiLU-mul
        self.layers_runner: LayersRunner | None = None  # run instead of the loop over the layers
        # The LoRA adapters' row selection (engine/lora): a step with adapter rows runs the
        # Python layers, which apply them; the layers runner does not.
        self.lora_step: LoRAStep | None = None
        # The step's image rows (engine/multimodal), set by the runner before a forward that
        # has any; None otherwise.
        self.mm_step: MultiModalStep | None = None

    # ------------------------------------------------------------ what a subclass provides

    @classmethod
    def describe(cls, cfg: PretrainedConfig) -> ArchitectureInfo:
        return ArchitectureInfo(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim_of(cfg),
            sliding_windows=sliding_windows(cfg),
            divisible=(
                ("attention heads", cfg.num_attention_heads),
                ("MLP columns", cfg.intermediate_size),
            ),
        )

    def build_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def attention(self, index: int, options: AttentionOptions) -> Attention:
        """Layer `index`'s attention, with this model's head shapes and this rank's heads."""
        info = self.info
        return Attention(
            self.config.hidden_size,
            info.num_heads,
            info.num_kv_heads,
            info.head_dim,
            index,
            self.shard,
            options,
        )

    def rope_settings(self) -> dict[str, dict]:
        """The rotary tables the layers read, by the name their attention options give."""
        return {"default": rope_parameters(self.config)}

    def embedding_scale(self) -> float | None:
        """A factor the embeddings are multiplied by (Gemma: sqrt(hidden_size))."""
        return None

    def final_softcap(self) -> float | None:
        """Logits become cap * tanh(logits / cap) (Gemma 2)."""
        return None

    def locate(self, name: str) -> tuple[str, str | None] | None:
        """(our parameter, part of it) for a checkpoint name with `model.` removed; None: a
        tensor this model does not use. Fused modules are found through `packed_modules`."""
        parts = name.split(".")
        for i, piece in enumerate(parts):
            if piece in self.packed_modules:
                ours, part = self.packed_modules[piece]
                return ".".join([*parts[:i], ours, *parts[i + 1 :]]), part
        return name, None

    # ------------------------------------------------------------------ shared behaviour

    def init_rotary(self, max_positions: int) -> None:
        weight = self.embed_tokens.weight
        self.rotary = {
            name: RotaryEmbedding(
                self.info.head_dim, max_positions, params, weight.device, weight.dtype
            )
            for name, params in self.rope_settings().items()
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, ctx = self._begin(input_ids, positions, backend, kv_caches, meta)
        lora_rows = self.lora_step is not None and self.lora_step.mask is not None
        if self.layers_runner is not None and not lora_rows:
            x = self.layers_runner(x, ctx)
        else:
            for layer in self.layers:
                x = layer(x, ctx)
        return self.norm(x, self.fused_ops)

    def forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s output, and each row's inputs to the layers `aux_layers` (the residual
        stream before them) side by side, [T, len(aux_layers) * hidden]: what an EAGLE-3
        head reads. The layers run one by one (a layers runner gives no intermediate)."""
        x, ctx = self._begin(input_ids, positions, backend, kv_caches, meta)
        aux: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            if index in aux_layers:
                aux[index] = x
            x = layer(x, ctx)
        return self.norm(x, self.fused_ops), torch.cat([aux[i] for i in aux_layers], dim=-1)

    def _begin(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, ForwardContext]:
        """The first layer's input and the context every layer reads."""
        if not self.rotary:
            raise RuntimeError("init_rotary() must run before the first forward")
        step = self.mm_step
        if step is not None and step.rope_positions is not None:
            assert self.mrope_section is not None, "multimodal positions for a 1-D rotary"
            section = self.mrope_section
            rope = {
                name: table.lookup_multimodal(step.rope_positions, section)
                for name, table in self.rotary.items()
            }
        else:
            rope = {name: table.lookup(positions) for name, table in self.rotary.items()}
        ctx = ForwardContext(rope, backend, kv_caches, meta, self.fused_ops)
        x = self.embed_tokens(input_ids)
        scale = self.embedding_scale()
        if scale is not None:  # in the activations' dtype, as the reference rounds it
            x = x * torch.tensor(scale, dtype=x.dtype)
        if step is not None and step.rows.numel():  # image rows: the encoder's, unscaled
            x = x.index_copy(0, step.rows, step.embeds.to(x.dtype))
        return x, ctx

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.lm_head_quantized is not None:
            logits = weight_only.linear(
                hidden, self.lm_head_quantized, None, self.lm_head_int8_activations
            )
        elif self.tie_word_embeddings:
            logits = linear(
                hidden, self.embed_tokens.weight, self.lm_head_packed, None, self.lm_head_packed_own
            )
        else:
            logits = self.lm_head(hidden)
        gathered = gather_columns(logits.float(), self.shard, self.config.vocab_size)
        cap = self.final_softcap()
        if gathered is not None and cap is not None:
            gathered = torch.tanh(gathered / cap) * cap
        return gathered

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_checkpoint(self, weights, self._locate)

    def _locate(self, hf_name: str) -> tuple[str, str | None] | None:
        if "rotary_emb" in hf_name:
            return None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return self.locate(name)
