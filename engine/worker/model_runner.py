"""Runs the model on one device: owns the weights and the paged KV cache of every layer.

The runner sees only `HostBatch` (token ids, positions and block tables), never the scheduler, so more
ranks can each run their own runner on the same input.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.loading.model_loader import load_model
from engine.loading.model_spec import ModelSpec
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots, PlacedAdapter
from engine.models.base import DecoderModel
from engine.models.interface import CausalLM
from engine.models.vision_language import VisionLanguageModel
from engine.multimodal.step_input import EncoderOutputs
from engine.pooling import pool
from engine.worker.cpu import prepare_model
from engine.worker.cpu.activation_choice import time_activations
from engine.worker.cpu.activation_quant import use_int8_activations
from engine.worker.cpu.quantize import quantize_int8
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.gpu_fused_ops import use_triton_fused_ops
from engine.worker.gpu_quantize import quantize_for_gpu
from engine.worker.model_input import HostBatch, PinnedUpload
from kernels.attention import AttentionBackend, build_backend
from kernels.cpu.huge_pages import huge_page_zeros, transparent_huge_pages
from kernels.cpu.malloc import keep_freed_memory
from kernels.kv_store import copy_blocks

log = logging.getLogger(__name__)


class ModelRunner:
    """The model, its attention backend and KV cache on one device. It starts with a one-block
    scratch cache, enough for the start-up profile step (whose slots are all -1); the engine then
    sizes the pool and calls `allocate_kv`, which also captures the decode CUDA graphs."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        spec: ModelSpec,
        device: torch.device,
        max_num_seqs: int,
        use_cuda_graphs: bool,
        lora: LoRASlots | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.backend = backend
        self.spec = spec
        self.max_num_seqs = max_num_seqs
        self.use_cuda_graphs = use_cuda_graphs
        self.device = device  # a tensor-parallel rank's own GPU, not always spec.device
        self.upload = PinnedUpload(self.device)
        model.init_rotary(spec.max_model_len)
        self.graphs: DecodeGraphs | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Layers whose inputs each step keeps for an EAGLE-3 head (`capture_aux_hidden`).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # Images' encoder outputs, kept from the step that encodes one until it is evicted.
        self.encoder_outputs = EncoderOutputs()
        self._allocate(1)

    def _allocate(self, num_blocks: int) -> None:
        self.kv_caches = []  # the old pool goes before the new one is made
        info = self.spec.info
        shape = (num_blocks, self.spec.block_size, self.spec.kv_heads_per_rank, info.head_dim)
        if self.device.type == "cpu":
            # One pool on huge pages: decode reads it block by block (kernels/cpu/huge_pages.py).
            pool = huge_page_zeros(2 * info.num_layers * math.prod(shape), self.spec.dtype)
            layers = pool.view(info.num_layers, 2, *shape)
            self.kv_caches = [(layer[0], layer[1]) for layer in layers]
            return
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.spec.dtype, device=self.device),
                torch.zeros(shape, dtype=self.spec.dtype, device=self.device),
            )
            for _ in range(info.num_layers)
        ]

    def allocate_kv(self, num_blocks: int) -> None:
        self.graphs = None
        self._allocate(num_blocks)
        shard = self.model.shard
        if shard.rank == 0:
            gib = self.spec.kv_bytes_per_block * num_blocks / 2**30
            per_rank = " per rank" if shard.size > 1 else ""
            log.info(
                "KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB%s",
                num_blocks,
                self.spec.block_size,
                num_blocks * self.spec.block_size,
                gib,
                per_rank,
            )
            thp = transparent_huge_pages() if self.device.type == "cpu" else None
            if thp is not None and thp not in ("always", "madvise"):
                log.info(
                    "KV cache on 4 KiB pages: the kernel's transparent huge pages are %s "
                    "(%s); decode attention reads the cache slower on them",
                    thp,
                    "/sys/kernel/mm/transparent_hugepage/enabled",
                )
        if self.use_cuda_graphs:
            started = time.perf_counter()
            self.graphs = DecodeGraphs(
                self.model,
                self.device,
                self.backend,
                self.kv_caches,
                self.max_num_seqs,
                -(-self.spec.max_model_len // self.spec.block_size),
                capture=True,
            )
            if shard.rank == 0:
                log.info(
                    "CUDA graphs: decode batch sizes %s captured in %.1f s",
                    self.graphs.sizes,
                    time.perf_counter() - started,
                )

    @torch.inference_mode()
    def execute(self, batch: HostBatch) -> torch.Tensor | None:
        """Logits (float32) of the rows in `batch.logits_indices` (None on ranks other than 0)."""
        copy_blocks(
            [k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], batch.block_copies
        )
        if self.lora is not None:
            self.lora.begin_step(batch.lora_slots, batch.query_lens, self.device)
        if self.aux_layers:
            return self._execute_with_aux(batch)
        if batch.mm is not None:
            return self._execute_with_images(batch)
        if self.graphs is not None and self.graphs.fits(batch):
            return self.model.compute_logits(self.graphs.run(batch, self.upload))
        inp = batch.to_device(self.device, self.upload)
        hidden = self.model(inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn)
        return self.model.compute_logits(hidden.index_select(0, inp.logits_indices))

    def _execute_with_images(self, batch: HostBatch) -> torch.Tensor | None:
        """A step with image rows (or encoder work): eager, the encoder's outputs in place of
        the image tokens' embeddings."""
        model = self.model
        assert isinstance(model, VisionLanguageModel) and batch.mm is not None
        model.mm_step = self.encoder_outputs.prepare(batch.mm, model.encode_image, self.device)
        try:
            inp = batch.to_device(self.device, self.upload)
            hidden = model(inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn)
        finally:
            model.mm_step = None
        return model.compute_logits(hidden.index_select(0, inp.logits_indices))

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """From now on every step keeps, for all its rows, the inputs to `layers`
        (`aux_hidden`); such steps run eagerly, layer by layer."""
        assert isinstance(self.model, DecoderModel), "aux hidden states of a decoder only"
        self.aux_layers = layers

    def _execute_with_aux(self, batch: HostBatch) -> torch.Tensor | None:
        assert isinstance(self.model, DecoderModel)
        inp = batch.to_device(self.device, self.upload)
        hidden, self.aux_hidden = self.model.forward_with_aux(
            inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn, self.aux_layers
        )
        return self.model.compute_logits(hidden.index_select(0, inp.logits_indices))

    def prepare_lora(self, request: LoRARequest) -> PlacedAdapter:
        """Read, check and slice an adapter for this rank without keeping it (LoRALoadError if
        it cannot be served): it touches no state that a step changes, so any thread may."""
        assert self.lora is not None, "prepare_lora() without --enable-lora"
        return self.lora.prepare(request)

    def read_lora(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None:
        """Read and check an adapter for this rank (LoRALoadError if it cannot be served),
        kept on the host for a slot; `prepared`: what `prepare_lora` made of it, kept as is."""
        assert self.lora is not None, "read_lora() without --enable-lora"
        if prepared is None:
            self.lora.read(request)
        else:
            self.lora.keep(request, prepared)

    @torch.inference_mode()
    def load_lora(self, slot: int, request: LoRARequest) -> None:
        """Put an adapter into a slot, between steps (LoRALoadError if it cannot be served)."""
        assert self.lora is not None, "load_lora() without --enable-lora"
        self.lora.load(slot, request)

    def forget_lora(self, request: LoRARequest) -> None:
        if self.lora is not None:
            self.lora.forget(request)

    @torch.inference_mode()
    def embed(self, batch: HostBatch) -> torch.Tensor:
        """One pooled embedding per sequence of an all-prefill step (each sequence whole),
        float32 on the host. A decoder writes its K/V through the batch's slots as usual; the
        engine frees those blocks right after."""
        pooler = self.spec.pooler
        assert pooler is not None, "embed() on a generating runner"
        inp = batch.to_device(self.device, self.upload)
        if self.lora is not None:  # the step's own mask, never the last generating step's
            self.lora.begin_step(batch.lora_slots, batch.query_lens, self.device)
        hidden = self.model(inp.input_ids, inp.positions, self.backend, self.kv_caches, inp.attn)
        return pool(hidden, batch.query_lens, pooler).cpu()


def graphs_off_reason(
    config: EngineConfig, spec: ModelSpec, backend: AttentionBackend
) -> str | None:
    """Why decode steps will run eagerly, or None when they will replay CUDA graphs."""
    if config.model.enforce_eager:
        return "--enforce-eager"
    if spec.pooler is not None:
        return "a pooling model runs every step as prefill"
    if not spec.device.startswith("cuda"):
        return f"not a CUDA device ({spec.device})"
    if not backend.graph_safe:
        return f"the {backend.name} attention backend cannot be captured"
    if config.lora.enable_lora:
        return "LoRA adapters pick their slots per step (--enable-lora)"
    if not spec.info.graph_safe:
        return f"{spec.architecture} reads routing decisions on the host"
    if spec.tensor_parallel_size > 1:
        return "not captured under tensor parallelism"
    return None


def build_runner(config: EngineConfig, spec: ModelSpec, shard: Shard) -> ModelRunner:
    """This rank's shard of the model and its runner (one GPU per rank on CUDA)."""
    device = spec.device
    if shard.size > 1 and device.startswith("cuda"):
        device = f"cuda:{shard.rank}"
    if device == "cpu":
        why_not = keep_freed_memory()
        if why_not is not None and shard.rank == 0:
            log.warning(
                "freed CPU memory goes back to the kernel (%s): each step page-faults its activations",
                why_not,
            )
    model = load_model(spec, shard, torch.device(device))
    invariant = config.model.batch_invariant
    backend = build_backend(spec.attention_backend, rows_alone=invariant)
    if spec.quantization is not None and device.startswith("cuda"):
        count = quantize_for_gpu(model, spec.quantization, torch.device(device))
        if shard.rank == 0:
            log.info("%d linear weights in their GPU form (%s)", count, spec.quantization)
    elif spec.quantization == "int8":
        count = quantize_int8(model)
        if shard.rank == 0:
            log.info("%d linear weights quantized to int8 (one scale per output row)", count)
    if spec.quantize_activations == "auto":  # timed on the loaded weights
        rows = sorted({1, min(16, config.scheduler.max_num_seqs)})
        timing = time_activations(model, spec.dtype, tuple(rows))
        use = timing is not None and timing.int8
        if shard.rank == 0:
            log.info(timing.describe() if timing else "activations: 16-bit (no linear takes int8)")
    else:
        use = spec.quantize_activations == "int8"
    if use:  # before the layer loop, which reads the marks
        named = config.model.quantize_activations == "int8"  # else the checkpoint declares them
        marked, total = use_int8_activations(model, named)
        if shard.rank == 0:
            rest = (
                " (the rest: groups or rows not whole blocks of 32 inputs)"
                if marked < total
                else ""
            )
            log.info("%d of %d quantized linears take int8 activations%s", marked, total, rest)
    # The CPU preparations (packed weights, fused ops, the C++ layer loop) are a decoder's.
    if device == "cpu" and not config.model.enforce_eager and not spec.info.encoder:
        prepare_model(
            model,
            backend,
            log_here=shard.rank == 0,
            fixed_order=invariant,
            lora=config.lora.enable_lora,
        )
    if device.startswith("cuda") and config.model.fused_kernels and not spec.info.encoder:
        why_not = use_triton_fused_ops(model)
        if shard.rank == 0:
            if why_not is None:
                log.info("norms, rotary + K/V store and SiLU-mul run as fused Triton kernels")
            else:
                log.warning("norms, rotary and SiLU stay torch ops (more kernels): %s", why_not)
    off = graphs_off_reason(config, spec, backend)
    if shard.rank == 0 and off is not None:
        log.info("CUDA graphs off: %s", off)
    lora = None
    if config.lora.enable_lora:
        # Encoders, experts and pooling were refused with the flag named (model_spec.lora_unfit).
        assert isinstance(model, DecoderModel), spec.architecture
        settings = config.lora
        lora = LoRASlots(
            model,
            settings.max_loras,
            settings.max_lora_rank,
            settings.max_cpu_loras or settings.max_loras,
        )
    return ModelRunner(
        model,
        backend,
        spec,
        torch.device(device),
        config.scheduler.max_num_seqs,
        use_cuda_graphs=off is None,
        lora=lora,
    )
