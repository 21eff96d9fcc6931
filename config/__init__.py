"""Typed configuration shared by every layer of pagedserve (imports no other package of ours)."""

from config.engine_config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from config.kv_events_config import KVEventsConfig
from config.kv_offload_config import KVOffloadConfig
from config.server_config import LoRAModule, ServeConfig, ServerConfig
from config.speculative_config import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "KVEventsConfig",
    "KVOffloadConfig",
    "LoRAConfig",
    "LoRAModule",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServeConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]
