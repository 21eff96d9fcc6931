"""`--kv-events-config`: where the engine publishes its KV cache events (blocks stored,
evicted, cleared) for prefix-aware routers such as llm-d's precise prefix-cache scorer.

The flag, its JSON keys and their meaning are vLLM's (`vllm/config/kv_events.py`), so a value
written for a vLLM deployment works here unchanged. Ours: `wire_format` (vLLM has changed how
it lays out one event, see engine/kv_events/wire.py, and consumers differ in which layout they
read), `bind`, and the default endpoint. vLLM binds `tcp://*:5557`, every interface, whatever
the HTTP server listens on; here, with no endpoint named, the events are bound on port 5557 of
the server's --host, so a server kept on loopback does not tell the network what its cache
holds. The Python API has no --host and binds loopback.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from config.json_settings import parse_json_settings

WireFormat = Literal["array", "map"]

DEFAULT_PORT = 5557  # vLLM's
OFFLINE_HOST = "127.0.0.1"  # where the Python API, which has no --host, publishes by default


def tcp_endpoint(host: str, port: int) -> str:
    """The ZMQ address of `port` on a host written as --host takes it: an IPv6 literal goes
    in brackets, and an empty host is every interface, as for a listening socket."""
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule for a named endpoint: a wildcard address, ipc:// or inproc:// is bound;
    anything else names a subscriber that binds (llm-d's central mode) and is connected to."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = Field(False, description="publish KV cache events")
    publisher: Literal["null", "zmq"] | None = Field(
        None, description="'zmq', or 'null' for none (default: zmq when events are enabled)"
    )
    endpoint: str | None = Field(
        None,
        min_length=1,
        description="ZMQ PUB address; a named one is bound when it has a wildcard ('*', '::') "
        "or is ipc:// or inproc://, else connected to (a central subscriber that binds), as in "
        "vLLM (default: tcp://<--host>:5557, bound: every interface only when --host is "
        "0.0.0.0 or ::; offline, with no --host: tcp://127.0.0.1:5557)",
    )
    bind: bool | None = Field(
        None,
        description="true: bind the endpoint (e.g. one chosen interface); false: connect to it "
        "(default: the default endpoint is bound, a named one as vLLM's rule above says)",
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
        if self.bind is False and self.endpoint is None:
            raise ValueError(
                "'bind': false connects to a subscriber that binds: name its address in "
                "'endpoint' (the default endpoint is this server's own)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def on_host(self, host: str) -> KVEventsConfig:
        """This config as `serve --host HOST` runs it: with no endpoint named, the default port
        on that host, bound (vLLM's rule would connect to a concrete address)."""
        if self.endpoint is not None:
            return self
        return self.model_copy(update={"endpoint": tcp_endpoint(host, DEFAULT_PORT), "bind": True})

    @property
    def address(self) -> str:
        """The address the PUB socket binds or connects to."""
        if self.endpoint is not None:
            return self.endpoint
        return tcp_endpoint(OFFLINE_HOST, DEFAULT_PORT)

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds `address` (else it connects to it)."""
        if self.bind is not None:
            return self.bind
        return self.endpoint is None or vllm_binds(self.endpoint)


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    return parse_json_settings(value, KVEventsConfig)
