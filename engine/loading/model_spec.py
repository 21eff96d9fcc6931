"""The model's settings, resolved once at start-up into a frozen `ModelSpec` that everything
below the engine reads: the weight loader, KV sizing, the runner, the CUDA graphs and the
tensor-parallel workers. Nothing below re-resolves a setting or looks inside a model's modules.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from transformers import PretrainedConfig

from config import ConfigError, EngineConfig, ModelConfig
from engine.distributed.shard import Shard, check_shardable
from engine.errors import ModelLoadError
from engine.loading.compressed_tensors import CompressedTensorsFormat
from engine.loading.default_model import gguf_path
from engine.loading.gguf_metadata import is_gguf
from engine.loading.hub import tokenizer_path
from engine.loading.linear_format import LinearFormat
from engine.loading.quantized_checkpoint import declared_quantization, flag_agrees, resolve_format
from engine.loading.resolve import load_hf_config, resolve_device, resolve_dtype, resolve_model_path
from engine.models.interface import ArchitectureInfo, text_config
from engine.models.registry import describe, image_processing_of, resolve_architecture
from engine.pooling import PoolerSpec, resolve_pooler
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
    # Set when the engine pools (--runner pooling, or auto on an encoder): embeddings, no text.
    pooler: PoolerSpec | None = None
    quantization: str | None = None  # --quantization (gguf: also a .gguf model)
    gguf_file: Path | None = None  # the weights, read from their blocks (--quantization gguf)
    # A checkpoint's own quantized format (compressed-tensors, GPTQ, AWQ), from its config.json.
    linear_format: LinearFormat | None = None
    # int8: activations rounded to int8 for the quantized linears (engine/worker/cpu/), as
    # --quantize-activations int8 or a W8A8/W4A8 checkpoint's declaration says (resolve_activations).
    quantize_activations: str | None = None
    # The model reads images in its prompts (a vision-language architecture).
    multimodal: bool = False

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.hf_config).vocab_size)

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


def context_limit(hf_config: PretrainedConfig, path: Path | None = None) -> int:
    """The longest context the model was trained for; sliding-window layers attend through
    their window, so a windowed model serves all of it. A sentence-transformers checkpoint may
    cap it lower (`max_seq_length`: what its embeddings were trained on)."""
    limit = int(getattr(text_config(hf_config), "max_position_embeddings", 2048))
    st_file = None if path is None else path / "sentence_bert_config.json"
    if st_file is not None and st_file.is_file():
        try:
            declared = json.loads(st_file.read_text()).get("max_seq_length")
        except (OSError, ValueError, AttributeError):
            declared = None
        if isinstance(declared, int) and 0 < declared < limit:
            limit = declared
    return limit


def resolve_runner(config: EngineConfig, info: ArchitectureInfo, tp_size: int) -> str:
    """generate or pooling; an encoder can only pool."""
    runner = config.model.runner
    if runner == "auto":
        runner = "pooling" if info.encoder else "generate"
    if runner == "generate" and info.encoder:
        raise ModelLoadError(
            "this model is an encoder: it embeds and cannot generate; start it with "
            "--runner pooling (or auto)"
        )
    if runner == "pooling" and tp_size > 1:
        raise ModelLoadError("--runner pooling runs on one device: no --tensor-parallel-size")
    return runner


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
    runner = resolve_runner(config, info, tp_size)
    pooler = None
    if runner == "pooling":
        pooler = resolve_pooler(config.model, path, int(hf_config.hidden_size), info.encoder)
    platform = Platform.detect(device, dtype, info.head_dim)
    choice = choose(config.model.attention_backend, platform, config.cache.block_size)
    log.info(
        "attention backend: %s, KV blocks of %d tokens (%s)",
        choice.name,
        choice.block_size,
        choice.why,
    )
    if config.model.batch_invariant:
        why_not = batch_invariance_unfit(device, dtype, choice.name, info)
        if why_not is not None:
            raise ConfigError(f"--batch-invariant: {why_not}")
        log.info(
            "batch-invariant: every row in a fixed order (linears and attention); prefill is slower"
        )
    quantization, gguf_file = resolve_quantization(config)
    linear_format = None
    if gguf_file is None:
        quantization, linear_format = resolve_checkpoint_quantization(quantization, path, hf_config)
    if quantization is not None:
        # A checkpoint of FP8 weights only never reaches the Triton kernel: FP8 matmuls, or
        # de-quantized weights where those do not run.
        fp8_only = (
            isinstance(linear_format, CompressedTensorsFormat) and linear_format.float_weights
        )
        why_not = quantization_unfit(
            quantization, platform, info, tp_size, config.model.batch_invariant, not fp8_only
        )
        if why_not is not None:
            what = quantization_source(config.model.quantization, path, gguf_file, linear_format)
            raise ConfigError(f"{what}: {why_not}")
        if linear_format is not None:
            linear_format = fp8_for_platform(linear_format, platform.capability)
            log.info("weights: %s", linear_format.describe())
        else:
            log.info("weights: %s (quantized at load)", quantization)
    activations = resolve_activations(config.model, quantization, linear_format, platform)
    if config.lora.enable_lora:
        why_not = lora_unfit(info, runner, quantization, config.model.batch_invariant)
        if why_not is not None:
            raise ConfigError(f"--enable-lora: {why_not}")
    multimodal = image_processing_of(architecture) is not None
    if multimodal:
        why_not = multimodal_unfit(config, runner, quantization, linear_format)
        if why_not is not None:
            raise ConfigError(f"{architecture} (images in prompts): {why_not}")
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
        max_model_len=config.resolve_max_model_len(context_limit(hf_config, path)),
        tensor_parallel_size=tp_size,
        pooler=pooler,
        quantization=quantization,
        gguf_file=gguf_file,
        linear_format=linear_format,
        quantize_activations=activations,
        multimodal=multimodal,
    )


def multimodal_unfit(
    config: EngineConfig, runner: str, quantization: str | None, linear_format: object
) -> str | None:
    """Why a vision-language model cannot run with these settings; None when it can."""
    if runner == "pooling":
        return "it generates; --runner pooling is not served for it"
    if config.parallel.tensor_parallel_size > 1:
        return "runs on one device (no --tensor-parallel-size yet)"
    if config.lora.enable_lora:
        return "LoRA adapters are not served on vision-language models yet (--enable-lora)"
    if config.scheduler.speculative_config is not None:
        return "speculative decoding is not served on vision-language models yet"
    if quantization is not None or linear_format is not None:
        return "its weights are read as stored in bf16/float32 (no --quantization)"
    return None


def resolve_quantization(config: EngineConfig) -> tuple[str | None, Path | None]:
    """--quantization, and the GGUF file whose blocks are the weights: the named .gguf model
    (gguf whether or not the flag says so), or the default model's own file."""
    named, model = config.model.quantization, config.model.model
    if model is not None and is_gguf(model):
        if named not in (None, "gguf"):
            raise ConfigError(
                f"--quantization {named}: a .gguf model is served from its own blocks "
                "(--quantization gguf, or no flag)"
            )
        return "gguf", Path(model).expanduser()
    if named == "gguf":
        if model is not None:
            raise ConfigError(
                f"--quantization gguf: serves a .gguf file (or, with no model, the default "
                f"model's), not {model}"
            )
        return "gguf", gguf_path()
    return named, None


def resolve_checkpoint_quantization(
    named: str | None, path: Path, hf_config: PretrainedConfig
) -> tuple[str | None, LinearFormat | None]:
    """A checkpoint whose config.json declares its quantization is served in that format, flag
    or not; a flag that names another one (or int8 of it) is a ConfigError naming both. fp8 of
    a plain checkpoint is vLLM's: quantized at load (on a GPU, see quantization_unfit)."""
    declared = declared_quantization(hf_config)
    if declared is None:
        if named in ("compressed-tensors", "gptq", "awq"):
            raise ConfigError(
                f"--quantization {named}: {path / 'config.json'} has no quantization_config; "
                "this flag serves a checkpoint saved in that format"
            )
        return named, None
    fmt = resolve_format(declared, path)
    if named is not None and not flag_agrees(named, fmt):
        raise ConfigError(
            f"--quantization {named} contradicts the checkpoint: {path / 'config.json'} says "
            f"quant_method {fmt.method} ({fmt.describe()}); leave the flag out to serve it"
        )
    return fmt.method, fmt


def fp8_matmul_unfit(capability: tuple[int, int] | None) -> str | None:
    """Why torch._scaled_mm's FP8 matmul does not run here, or None."""
    if capability is None:
        return "FP8 matmuls run on a GPU (compute capability 8.9 or later), not the CPU"
    if capability < (8, 9):
        major, minor = capability
        return f"FP8 matmuls need compute capability 8.9 or later, not {major}.{minor}"
    return None


def fp8_for_platform(fmt: LinearFormat, capability: tuple[int, int] | None) -> LinearFormat:
    """A checkpoint's FP8 weights run as stored where the FP8 matmul runs. Elsewhere they are
    de-quantized at load and served, as vLLM serves an FP8 checkpoint on a GPU without FP8
    (weight-only there): the checkpoint still runs, slower and larger, and the log says so."""
    if not isinstance(fmt, CompressedTensorsFormat) or not fmt.has_float:
        return fmt
    why_not = fp8_matmul_unfit(capability)
    if why_not is not None and capability is not None:  # a GPU: say where the speed went
        log.warning("FP8 checkpoint: its FP8 weights are de-quantized at load (%s)", why_not)
    return replace(fmt, fp8_kernel=why_not is None)


def quantization_source(
    named: str | None, path: Path, gguf_file: Path | None, linear_format: LinearFormat | None
) -> str:
    """What asked for the quantization, for a refusal to name: the flag, or, without it, the
    file it was detected from (a user who gave no flag looks for the cause in the model)."""
    if named is not None:
        return f"--quantization {named}"
    if linear_format is not None:
        return f"{path}: a {linear_format.method} checkpoint (config.json's quantization_config)"
    assert gguf_file is not None  # the only other way a quantization is set without the flag
    return f"{gguf_file}: a GGUF file (its blocks are the weights)"


def quantization_unfit(
    quantization: str,
    platform: Platform,
    info: ArchitectureInfo,
    tp_size: int,
    batch_invariant: bool,
    needs_triton: bool = True,
) -> str | None:
    """Why this weight quantization cannot run here, or None. On the CPU: int8 and gguf on
    kernels/cpu/quant_linear, bfloat16 or float32 activations. On a GPU (kernels/gpu_quant):
    fp8 through torch._scaled_mm (compute capability 8.9+), int8 and gguf through the Triton
    W4A16/W8A16 kernel (8.0+), bfloat16 or float16 activations. Either: the linears of a decoder
    on one rank."""
    dtype_name = str(platform.dtype).removeprefix("torch.")
    if platform.capability is None:
        if quantization == "fp8":
            return "it runs on a GPU (compute capability 8.9 or later), not the CPU"
        if platform.dtype not in (torch.bfloat16, torch.float32):
            return f"its kernel takes bfloat16 or float32, not {dtype_name}"
    else:
        major, minor = platform.capability
        if platform.dtype not in (torch.bfloat16, torch.float16):
            return f"its GPU kernels take bfloat16 or float16, not {dtype_name}"
        if quantization == "fp8" and fp8_matmul_unfit(platform.capability) is not None:
            return fp8_matmul_unfit(platform.capability)
        needs_triton = needs_triton and quantization != "fp8"
        if needs_triton and major < 8:
            return f"its Triton kernel needs compute capability 8.0 or later, not {major}.{minor}"
        if needs_triton:
            why_not = platform.importable("triton")
            if why_not is not None:
                return f"its GPU kernel is Triton's: {why_not}"
    if info.encoder:
        return "it is for decoder models"
    if tp_size > 1:
        return "it runs on one rank, not --tensor-parallel-size > 1"
    if batch_invariant:
        # Its kernel widens a tile of weights to bfloat16 first from a few rows on: the sums of
        # a row then depend on how many rows share its step (on a GPU, the tiles depend on the
        # rows too).
        return "not with --batch-invariant (its kernel's order depends on the batch's rows)"
    return None


def resolve_activations(
    model: ModelConfig,
    quantization: str | None,
    linear_format: LinearFormat | None,
    platform: Platform,
) -> Literal["int8", "auto"] | None:
    """int8 where --quantize-activations int8 says so (refused where it cannot run), or where a
    checkpoint declares dynamic int8 activations (W8A8, W4A8) and they can run here; auto where
    that flag says so and they can run (the runner times both paths once the weights load); else
    None: the activations as they are (bf16 or float32 products, more exact than the checkpoint
    asked for where it declared int8 ones)."""
    named = model.quantize_activations
    declared = isinstance(linear_format, CompressedTensorsFormat) and linear_format.int8_activations
    if named == "none" or (named is None and not declared):
        if declared:
            log.info("activations: 16-bit (--quantize-activations none), not the checkpoint's int8")
        elif (
            named is None
            and isinstance(linear_format, CompressedTensorsFormat)
            and any(s.int8_activations for s in linear_format.schemes)
        ):
            log.info(
                "activations: 16-bit: only some of the checkpoint's schemes declare dynamic "
                "int8 ones (--quantize-activations int8 would round them for every linear)"
            )
        return None
    why_not = activation_quantization_unfit(quantization, platform)
    fp8 = isinstance(linear_format, CompressedTensorsFormat) and linear_format.float_weights
    if why_not is None and fp8:  # de-quantized at load or run as FP8: no integer linear at all
        why_not = "its kernel is for integer weights, and this checkpoint's are FP8"
    if why_not is not None:
        if named == "int8":
            raise ConfigError(f"--quantize-activations int8: {why_not}")
        if named == "auto":
            log.info("activations: 16-bit (--quantize-activations auto; int8: %s)", why_not)
            return None
        log.info("activations: 16-bit, not the checkpoint's dynamic int8 (%s)", why_not)
        return None
    if named == "auto":
        return "auto"
    source = "--quantize-activations int8" if named == "int8" else "the checkpoint's dynamic int8"
    log.info("activations: %s, rounded per block of 32 inputs (integer products)", source)
    return "int8"


def activation_quantization_unfit(quantization: str | None, platform: Platform) -> str | None:
    """Why int8 activations cannot run here, or None. They are for integer weights, 4-bit or
    8-bit (--quantization int8, gguf, compressed-tensors, gptq, awq), on the CPU, where it has the
    integer dot products (AVX512-VNNI) and byte permutes (AVX512-VBMI) of kernels/cpu/quant_linear.
    (The config refuses the flag with --batch-invariant, and quantization_unfit quantized weights
    with it.)"""
    if quantization is None:
        return (
            "it needs quantized weights (--quantization int8 or gguf, a .gguf model or a quantized "
            "checkpoint)"
        )
    if quantization == "fp8":
        return "its kernel is for integer weights, not --quantization fp8's float8 ones"
    if platform.capability is not None:
        return "it runs on the CPU, not a GPU"
    try:
        from kernels.cpu import quant_linear
    except ImportError as exc:
        return f"its kernel (kernels/cpu/quant_linear) does not load: {exc}"
    if not quant_linear.VNNI:
        return (
            "this CPU lacks AVX512-VNNI, AVX512-VBMI or AVX512-BF16 (the kernel's integer dot "
            "products, byte permutes and bf16 stores)"
        )
    return None


def lora_unfit(
    info: ArchitectureInfo, runner: str, quantization: str | None, batch_invariant: bool
) -> str | None:
    """Why LoRA adapters cannot be served here, or None: they are for a generating decoder with
    dense MLPs, on weights that are not quantized."""
    if info.encoder or info.experts or runner != "generate":
        return "adapters are for generating decoder models with dense MLPs"
    if quantization is not None:
        return f"not with quantized weights ({quantization}) yet"
    if batch_invariant:
        return "not with --batch-invariant (the adapters' update is not in a fixed order)"
    return None


def batch_invariance_unfit(
    device: str, dtype: torch.dtype, backend: str, info: ArchitectureInfo
) -> str | None:
    """Why --batch-invariant cannot hold here, or None. It holds where every linear runs on
    kernels/cpu/bf16_linear and every attention row on the cpu backend's decode path, whose sums
    have one order whatever the batch; other kernels choose their blocking by the shape."""
    if info.encoder:
        return "it is for decoder models (an encoder keeps its torch layers)"
    if info.experts:
        return (
            "not for a mixture of experts (each expert multiplies the rows the batch routes to it)"
        )
    if device != "cpu":
        return f"it runs on the CPU, not {device}"
    if dtype != torch.bfloat16:
        return f"it runs in bfloat16 (--dtype bfloat16), not {str(dtype).removeprefix('torch.')}"
    if backend != "cpu":
        return f"it needs the cpu attention backend, not {backend}"
    if not fixed_order_available():
        return "its linear kernel (kernels/cpu/bf16_linear) needs a CPU with AVX512-BF16 and did not load here"
    return None
