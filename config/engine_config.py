"""Engine configuration: model, KV cache and scheduler settings, validated at start-up.

Field names are the CLI flags' names in snake_case (`--max-num-seqs` -> `max_num_seqs`), so a
validation error can always name the flag the user typed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

AttentionBackendName = Literal["auto", "torch"]
DType = Literal["auto", "float32", "float16", "bfloat16"]


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
    # None means the bundled default model (SmolLM2-135M-Instruct).
    model: str | None = None
    tokenizer: str | None = None
    dtype: DType = "auto"
    device: str = "cpu"
    seed: int = Field(0, ge=0, description="seed of the sampler's generator for unseeded requests")
    model_cache_dir: Path = Field(default_factory=default_cache_dir)
    attention_backend: AttentionBackendName = "auto"


class CacheConfig(_Strict):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block, a power of two")
    # Either a fixed number of blocks or a memory budget; the block count wins when both are set.
    num_kv_blocks: int | None = Field(None, ge=1, le=10_000_000)
    kv_cache_memory_gib: float = Field(1.0, gt=0, le=4096)
    enable_prefix_caching: bool = True

    @model_validator(mode="after")
    def _power_of_two(self) -> "CacheConfig":
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"{flag('block_size')} must be a power of two between 1 and 1024, got {self.block_size}"
            )
        return self


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(2048, ge=1, le=1_048_576)
    # None means the model's own limit (max_position_embeddings).
    max_model_len: int | None = Field(None, ge=2, le=10_000_000)


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from flat flag-named keyword arguments, as `LLM(...)` and the CLI pass them."""
        sections: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {
            name: section
            for section, model in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig))
            for name in model.model_fields
        }
        for key, value in kwargs.items():
            if key not in owners:
                known = ", ".join(sorted(owners))
                raise ConfigError(f"unknown setting {key!r} ({flag(key)}); known settings: {known}")
            sections[owners[key]][key] = value
        built: dict[str, BaseModel] = {}
        for name, section in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            try:
                built[name] = section(**sections[name])
            except ValidationError as exc:
                raise ConfigError(describe(exc, section)) from None
        return cls(**built)

    def resolve_max_model_len(self, model_limit: int, num_blocks: int) -> int:
        """The context limit in force, checked against what the model and the KV pool can hold."""
        max_len = self.scheduler.max_model_len or model_limit
        if max_len > model_limit:
            raise ConfigError(
                f"{flag('max_model_len')} must be between 2 and the model's limit {model_limit}, got {max_len}"
            )
        capacity = num_blocks * self.cache.block_size
        if capacity < max_len:
            raise ConfigError(
                f"the KV pool ({num_blocks} blocks x {self.cache.block_size} tokens = {capacity} tokens) cannot "
                f"hold one sequence of {flag('max_model_len')} {max_len}: raise {flag('num_kv_blocks')} to at "
                f"least {-(-max_len // self.cache.block_size)} or lower {flag('max_model_len')}"
            )
        return max_len


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
