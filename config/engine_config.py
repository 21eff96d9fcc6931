"""Engine configuration: model, KV cache and scheduler settings, validated at start-up.

Field names are the CLI flags' names in snake_case (`--max-num-seqs` -> `max_num_seqs`), so a
validation error can always name the flag the user typed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from config.kv_events_config import KVEventsConfig, parse_kv_events_config
from config.kv_offload_config import KVOffloadConfig
from config.speculative_config import SpeculativeConfig, parse_speculative_config

AttentionBackendName = Literal["auto", "torch", "cpu", "triton", "flash-attn", "flash-attn-4"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
# vLLM's --quantization names that pagedserve serves (int8: its own, of a bf16/float32 checkpoint;
# compressed-tensors, gptq, awq name a checkpoint's own format, which is also detected; fp8: an
# FP8 checkpoint's, or as vLLM's, a bf16/fp16 checkpoint quantized at load on a GPU).
Quantization = Literal["int8", "gguf", "compressed-tensors", "gptq", "awq", "fp8"]


class ConfigError(ValueError):
    """An invalid setting, reported with the flag that sets it and the allowed range."""


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def default_cache_dir() -> Path:
    """Where converted models are kept: `$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pagedserve"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Strict):
    model: str | None = Field(
        None,
        description="local Hugging Face model folder, or a Hub repo id org/name (default: the bundled "
        "SmolLM2-135M-Instruct)",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer folder or Hub repo id, when it is not the model's"
    )
    revision: str | None = Field(
        None,
        min_length=1,
        description="branch, tag or commit of a Hub model (default: main; a local folder has none)",
    )
    download_dir: Path | None = Field(
        None,
        description="Hugging Face hub cache that Hub models are downloaded into and loaded from "
        "(default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
    )
    dtype: DType = Field(
        "auto",
        description="weight and activation dtype (auto: the model's on a GPU; on a CPU bfloat16 where it "
        "multiplies bfloat16 natively, AVX512-BF16 or AMX, else float32)",
    )
    device: str = Field(
        "auto",
        description="torch device the model runs on (auto: cuda when torch sees a GPU, else cpu)",
    )
    seed: int = Field(0, ge=0, description="seed of the sampler's generator for unseeded requests")
    model_cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="where converted models are kept (default: $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve)",
    )
    attention_backend: AttentionBackendName = Field(
        "auto",
        description="attention kernel (auto: on a GPU triton, else flash-attn 2; on the CPU the C++ paged kernel, cpu; else torch; flash-attn-4 only when named)",
    )
    enforce_eager: bool = Field(
        False,
        description="run decode steps eagerly instead of replaying CUDA graphs, and keep CPU weights unpacked",
    )
    fused_kernels: bool = Field(
        True,
        description="on a CUDA GPU, run each decoder layer's RMSNorms (with their residual adds), "
        "q/k norms + rotary + K/V store, and SiLU-mul as fused Triton kernels, fewer kernels a "
        "step; --no-fused-kernels: the torch ops (the CPU has its own fused ops either way)",
    )
    batch_invariant: bool = Field(
        False,
        description="make a request's output independent of the batch it runs in (bfloat16 on the CPU): every "
        "row of every linear and every attention row computed in one fixed order; prefill is slower",
    )
    quantization: Quantization | None = Field(
        None,
        description="weight quantization (int8: every linear weight quantized at load to int8 with a "
        "float32 scale per output row; gguf: a .gguf file's blocks (Q8_0, Q4_0/1, Q5_0/1, Q4_K, "
        "Q5_K, Q6_K) as they are, the default model's own file when no model is named; a .gguf "
        "model is gguf without the flag; "
        "compressed-tensors, gptq, awq, fp8: a checkpoint's own quantized format, detected from its "
        "quantization_config without the flag; fp8 of a bf16/fp16 checkpoint, on a GPU only: "
        "weights quantized at load to float8_e4m3fn with a scale per output channel, activations "
        "per token; default: the checkpoint's weights)",
    )
    quantize_activations: Literal["int8", "auto", "none"] | None = Field(
        None,
        description="int8: integer quantized weights (--quantization int8, gguf, compressed-tensors, "
        "gptq, awq; 4-bit or 8-bit, in groups of a multiple of 32 inputs or whole rows) multiplied "
        "with their activations rounded to int8 per block of 32 (integer products, AVX512-VNNI on "
        "the CPU: faster, not the exact numbers); none: activations as they are, also for a "
        "checkpoint that declares dynamic int8 ones (W8A8, W4A8); auto: int8 where they can run "
        "and the model's own linears, timed both ways at start-up, are clearly faster with them "
        "(the log says the times); default: int8 where such a checkpoint declares them and they "
        "run here, else activations as they are",
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="generate: text generation; pooling: embeddings (/v1/embeddings, /v1/score, "
        "/v1/rerank); auto: pooling for an encoder model, else generate (no model with pooling: "
        "the bundled all-MiniLM-L6-v2)",
    )
    pooling_type: Literal["auto", "mean", "cls", "last"] = Field(
        "auto",
        description="how a pooling model reduces its hidden states to one vector (auto: the "
        "checkpoint's 1_Pooling/config.json, else last for a decoder and cls for an encoder)",
    )
    normalize: bool | None = Field(
        None,
        description="L2-normalize embeddings (default: as the checkpoint's modules.json says, "
        "with or without a Normalize module; normalized when there is no modules.json)",
    )

    @model_validator(mode="after")
    def _invariant_fits(self) -> ModelConfig:
        # The fixed-order linear kernel reads prepacked weights, which --enforce-eager keeps as loaded.
        if self.batch_invariant and self.enforce_eager:
            raise ValueError(
                f"{flag('batch_invariant')} needs the prepacked CPU weights that {flag('enforce_eager')} turns off"
            )
        if self.batch_invariant and self.quantize_activations == "int8":
            raise ValueError(
                f"{flag('quantize_activations')} is not for {flag('batch_invariant')} (its weights "
                "are quantized, and their kernel's order depends on the batch's rows)"
            )
        return self


class CacheConfig(_Strict):
    block_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="tokens per KV block, a power of two (default: the attention backend's: 256 for flash-attn, "
        "128 for flash-attn-4, else 16)",
    )
    # The pool is sized by the first of these that is set: a block count, a memory budget, or
    # (on a GPU) the share of GPU memory left after the weights and a profiled step.
    num_kv_blocks: int | None = Field(
        None, ge=1, le=10_000_000, description="KV pool size in blocks"
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="KV pool budget in GiB when --num-kv-blocks is unset (default on CPU: 1, or what "
        "--max-num-seqs sequences of --max-model-len tokens hold if less; on GPU, sized from "
        "--gpu-memory-utilization)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of the GPU's memory this engine may use: weights, activations of the largest step, KV pool",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of shared prompt prefixes"
    )
    kv_events_config: KVEventsConfig | None = Field(
        None,
        description="publish KV cache events (blocks stored, evicted, cleared) over ZMQ for "
        "prefix-aware routers, in vLLM's format: a JSON object of vLLM's keys, e.g. "
        "'{\"enable_kv_cache_events\": true}', bound on tcp://<--host>:5557 (offline, with "
        "no --host: 127.0.0.1), unlike vLLM's every interface; a named endpoint "
        '("tcp://*:5557") works as in vLLM, and "bind": true/false says whether it is bound '
        "or connected to (default: off)",
    )

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_kv_events_config(cls, value: object) -> KVEventsConfig | None:
        return parse_kv_events_config(value)

    @model_validator(mode="after")
    def _power_of_two(self) -> CacheConfig:
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(
                f"{flag('block_size')} must be a power of two between 1 and 1024, got {self.block_size}"
            )
        return self


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1, le=4096, description="most sequences in one step")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1_048_576, description="token budget of one step"
    )
    max_model_len: int | None = Field(
        None, ge=2, le=10_000_000, description="context limit in tokens (default: the model's)"
    )
    async_scheduling: bool | None = Field(
        None,
        description="schedule and build the next step while the model runs the current one, and "
        "make a step's outputs while the next runs (default: on with CUDA, off on the CPU; "
        "refused for pooling models, --enable-lora and tensor parallelism)",
    )
    encoder_cache_size: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="image encoder outputs kept between steps, in embedding rows, and the most "
        "a step encodes; an image larger is refused (default: the larger of "
        "--max-num-batched-tokens and 16384)",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: requests in arrival order; priority: by each request's priority "
        "(lower first, then arrival), a running sequence of the lowest priority preempted first",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="speculative decoding, a JSON object of vLLM's keys: e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup) or '
        '\'{"model": "<draft>", "num_speculative_tokens": 4}\' (a draft model); greedy '
        "requests get exactly the tokens they get without it (default: off)",
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value: object) -> SpeculativeConfig | None:
        return parse_speculative_config(value)


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="ranks (processes; one GPU each on GPU) that split every layer's heads and columns",
    )
    distributed_timeout: float = Field(
        300.0,
        gt=0,
        description="seconds one collective may wait for the other ranks before the engine gives up",
    )


class StructuredOutputsConfig(_Strict):
    """Bounds on what one request's output constraint may cost to compile: a schema or grammar
    past them is a 400 before any compile starts, and a compile past the timeout is abandoned."""

    grammar_compile_timeout: float = Field(
        10.0, gt=0, description="seconds a constraint may take to compile (waiting included)"
    )
    max_grammar_bytes: int = Field(
        1_048_576, ge=1, description="largest constraint source: schema, regex, grammar, choices"
    )
    max_schema_depth: int = Field(64, ge=1, description="deepest nesting of a JSON schema")
    max_schema_properties: int = Field(
        1000, ge=1, description="most properties a JSON schema declares, all objects together"
    )
    max_grammar_rules: int = Field(2000, ge=1, description="most rules in an EBNF grammar")
    json_whitespace: int = Field(
        0,
        ge=-1,
        le=64,
        description="whitespace characters a JSON constraint allows between tokens "
        "(0: none; -1: any number, as vLLM)",
    )
    grammar_cache_mib: int = Field(
        256, ge=0, description="memory the compiled grammars kept for reuse may take"
    )


class LoRAConfig(_Strict):
    """LoRA adapters served beside the base weights: how many may run in one step (GPU slots),
    how many stay loaded on the host, and the largest rank a slot holds."""

    enable_lora: bool = Field(False, description="serve LoRA adapters (PEFT checkpoints)")
    max_loras: int = Field(
        1, ge=1, le=256, description="distinct adapters in one step (slots on the linear layers)"
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="largest adapter rank a slot holds (a higher one is refused)"
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="adapters kept read on the host for reloading into a slot (default: --max-loras)",
    )
    lora_load_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a run-time adapter load may spend reading and checking its files "
        "(off the engine thread); past it that load fails with a 400 and serving goes on",
    )

    @model_validator(mode="after")
    def _cpu_holds_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"{flag('max_cpu_loras')} ({self.max_cpu_loras}) must be at least "
                f"{flag('max_loras')} ({self.max_loras})"
            )
        return self


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    structured: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    kv_offload: KVOffloadConfig = Field(default_factory=KVOffloadConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat flag-named keyword arguments, as `LLM(...)` and the CLI pass them."""
        return cls(**build_sections(ENGINE_SECTIONS, kwargs))

    def resolve_max_model_len(self, model_limit: int) -> int:
        """The context limit in force: --max-model-len, checked against the model's, else the model's."""
        max_len = self.scheduler.max_model_len or model_limit
        if max_len > model_limit:
            raise ConfigError(
                f"{flag('max_model_len')} must be between 2 and the model's limit {model_limit}, got {max_len}"
            )
        return max_len

    def check_kv_capacity(self, max_model_len: int, num_blocks: int, block_size: int) -> None:
        """The KV pool must hold at least one sequence of the longest context."""
        capacity = num_blocks * block_size
        if capacity < max_model_len:
            raise ConfigError(
                f"the KV pool ({num_blocks} blocks x {block_size} tokens = {capacity} tokens) cannot "
                f"hold one sequence of {flag('max_model_len')} {max_model_len}: raise {flag('num_kv_blocks')} to at "
                f"least {-(-max_model_len // block_size)} or lower {flag('max_model_len')}"
            )


ENGINE_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "structured": StructuredOutputsConfig,
    "lora": LoRAConfig,
    "kv_offload": KVOffloadConfig,
}


def build_sections(
    sections: dict[str, type[BaseModel]], kwargs: dict[str, object]
) -> dict[str, BaseModel]:
    """Route flat flag-named settings to the section that owns each, and validate every section."""
    owners = {name: key for key, model in sections.items() for name in model.model_fields}
    routed: dict[str, dict[str, object]] = {key: {} for key in sections}
    for name, value in kwargs.items():
        if name not in owners:
            known = ", ".join(sorted(owners))
            raise ConfigError(f"unknown setting {name!r} ({flag(name)}); known settings: {known}")
        routed[owners[name]][name] = value
    built: dict[str, BaseModel] = {}
    for key, model in sections.items():
        try:
            built[key] = model(**routed[key])
        except ValidationError as exc:
            raise ConfigError(describe(exc, model)) from None
    return built


_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _allowed_range(section: type[BaseModel], name: str) -> str | None:
    """A field's numeric bounds as words, e.g. ">= 1 and <= 4096"."""
    info = section.model_fields.get(name)
    if info is None:
        return None
    bounds = [
        f"{symbol} {getattr(m, attr)}"
        for m in info.metadata
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        if getattr(m, attr, None) is not None
    ]
    return " and ".join(bounds) or None


def describe(exc: ValidationError, section: type[BaseModel]) -> str:
    """One line per invalid field of `section`, naming its CLI flag and, for a number out of
    bounds, the whole allowed range."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"] if isinstance(part, str)]
        if not loc:  # a check across fields: its message names the flags itself
            lines.append(str(err.get("ctx", {}).get("error", err["msg"])))
            continue
        allowed = _allowed_range(section, loc[-1]) if err["type"] in _BOUND_ERRORS else None
        message = f"must be {allowed}" if allowed else err["msg"]
        lines.append(f"{flag(loc[-1])}: {message} (got {err.get('input')!r})")
    return "; ".join(lines)
