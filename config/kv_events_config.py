"""`--kv-events-config`: where the engine publishes its KV cache events (blocks stored,
evicted, cleared) for prefix-aware routers such as llm-d's precise prefix-cache scorer.

The flag, its JSON keys, their meaning and defaults are vLLM's (`vllm/config/kv_events.py`),
so a value written for a vLLM deployment works here unchanged. `wire_format` is ours: vLLM
has changed how it lays out one event (see engine/kv_events/wire.py), and consumers differ in
which layout they read.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WireFormat = Literal["array", "map"]


class KVEventsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(False, description="publish KV cache events")
    publisher: Literal["null", "zmq"] | None = Field(
        None, description="'zmq', or 'null' for none (default: zmq when events are enabled)"
    )
    endpoint: str = Field(
        "tcp://*:5557",
        min_length=1,
        description="ZMQ PUB address: bound when it has a wildcard ('*', '::') or is ipc:// or "
        "inproc://, else connected to (a central subscriber that binds)",
    )
    replay_endpoint: str | None = Field(
        None, min_length=1, description="ZMQ ROUTER address (bound) that replays missed batches"
    )
    buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    hwm: int = Field(100_000, ge=0, description="ZMQ send high-water mark of the PUB socket")
    max_queue_size: int = Field(
        100_000,
        ge=1,
        description="batches waiting for the publisher thread; beyond it batches are dropped "
        "(counted) rather than the engine step waiting",
    )
    topic: str = Field("", description="the topic frame of every message")
    wire_format: WireFormat = Field(
        "array",
        description="'array': each event a positional array, tag first (vLLM before its map "
        "encoding; what every llm-d release reads); 'map': each event a map with a 'type' key "
        "(vLLM since its map encoding)",
    )

    @model_validator(mode="after")
    def _resolve_publisher(self) -> KVEventsConfig:
        if self.publisher is None:
            # vLLM's rule: enabling events without naming a publisher means ZMQ.
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        return self

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    """The setting from a JSON string (the flag, the environment), a mapping (a config file,
    `LLM(...)`) or a built config; a ValueError that names the bad key otherwise."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object of settings, got {type(value).__name__}")
    try:
        return KVEventsConfig.model_validate(value)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"]) or "value"
            if err["type"] == "extra_forbidden":
                known = ", ".join(KVEventsConfig.model_fields)
                problems.append(f"unknown key {key!r} (known keys: {known})")
            else:
                problems.append(f"key {key!r}: {err['msg']} (got {err.get('input')!r})")
        raise ValueError("; ".join(problems)) from None
