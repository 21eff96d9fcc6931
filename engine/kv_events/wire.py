"""vLLM's KV-event wire format, encoded with msgpack by hand (no msgspec structs).

The facts, and where they come from:

- One ZMQ message per batch, three frames: [topic (UTF-8), sequence number (8 bytes,
  big-endian, from 0, one per batch), payload] (vLLM `vllm/distributed/kv_events.py`,
  `ZmqEventPublisher._publisher_thread`; llm-d-kv-cache `pkg/kvevents/zmq_subscriber.go`
  reads the same three frames).
- The payload is an `EventBatch`, a msgspec Struct declared `array_like=True`: the positional
  array `[ts, events, data_parallel_rank]`, ts a float of seconds since the epoch. vLLM's
  publisher stamps its data-parallel rank before encoding, so the third element is always
  there. (A message captured from vLLM 0.26.0, quoted in volcano-sh/kthena issue #1535, has
  exactly this shape; llm-d's `msgpackVLLMEventBatch` decodes it with `msgpack:",array"`.)
- Each event is a `KVCacheEvent` subclass, declared `tag=True, omit_defaults=True`:
  * "array" layout: until vLLM PR #42892 (merged 2026-06) the events were `array_like=True`
    as well: a positional array whose first element is the class name (the tag), then every
    field in declaration order. msgspec does not thin an array under `omit_defaults`
    (jcrist/msgspec#720), so unset fields are nil, not absent. llm-d-kv-cache's
    `engineadapter/vllm_adapter.go` reads these positions, with length guards:
      BlockStored      [tag, block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id, medium, lora_name, extra_keys, group_idx,
                        kv_cache_spec_kind, kv_cache_spec_sliding_window]
      BlockRemoved     [tag, block_hashes, medium, group_idx]
      AllBlocksCleared [tag]
  * "map" layout: since #42892 each event is a map with the tag under "type" and the fields
    by name, fields with a default left out while they hold it (`extra_keys`,
    `kv_cache_spec_sliding_window` when None). llm-d-kv-cache reads both since its PR #661.
- Block hashes: vLLM's `maybe_convert_block_hash` sends, by default
  (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), the low 64 bits of the block's digest as an
  unsigned int (a msgpack uint64). Ours are the low 64 bits of our own chained blake2b-128
  digest (engine/core/kv_cache_manager.py), the same 8 bytes llm-d's `getHashAsUint64` would
  take from a bytes hash. They identify blocks within this engine only: a consumer matches
  them to one another (a parent to its child, a removal to its store), never to vLLM's.
- `medium` is "GPU", vLLM's name for the engine's own KV pool (what llm-d treats as the
  default tier), even when the pool lives in CPU memory; "CPU" is the host-memory offload tier
  (vLLM's OffloadingConnector reports its CPU tier so). The disk tier is not reported: its
  blocks outlive the process, and nothing could tell a subscriber of a restarted engine which
  tokens the files it kept hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from config.kv_events_config import WireFormat
from engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

U64 = (1 << 64) - 1


def external_hash(block_hash: bytes) -> int:
    """The hash a consumer sees: the digest's low 64 bits, unsigned (vLLM's int form)."""
    return int.from_bytes(block_hash, "big") & U64


@dataclass(frozen=True)
class CacheSpec:
    """What every BlockStored says about the cache it came from: one group (index 0), full
    attention unless every layer has a sliding window."""

    block_size: int
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_window"


def event_fields(event: KVEvent, spec: CacheSpec) -> tuple[str, list[tuple[str, Any, bool]]]:
    """The event's tag and its (field, value, has a default) triples in vLLM's order."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return "BlockStored", [
            ("block_hashes", [external_hash(h) for h in event.block_hashes], False),
            ("parent_block_hash", None if parent is None else external_hash(parent), False),
            ("token_ids", event.token_ids, False),
            ("block_size", event.block_size, False),
            ("lora_id", event.lora_id, False),
            ("medium", event.medium, False),
            ("lora_name", event.lora_name, False),
            ("extra_keys", event.extra_keys, True),
            ("group_idx", 0, True),
            ("kv_cache_spec_kind", spec.kind, True),
            ("kv_cache_spec_sliding_window", spec.sliding_window, True),
        ]
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", [external_hash(h) for h in event.block_hashes], False),
            ("medium", event.medium, False),
            ("group_idx", 0, True),
        ]
    assert isinstance(event, AllBlocksCleared)
    return "AllBlocksCleared", []


def wire_event(event: KVEvent, spec: CacheSpec, layout: WireFormat) -> list[Any] | dict[str, Any]:
    tag, fields = event_fields(event, spec)
    if layout == "array":
        return [tag, *(value for _, value, _ in fields)]
    # msgspec's omit_defaults: a field that has a default (vLLM's are all None) is left out
    # while it holds it; a field without one is always written, nil or not.
    wire: dict[str, Any] = {"type": tag}
    for name, value, has_default in fields:
        if not (has_default and value is None):
            wire[name] = value
    return wire


def encode_batch(
    ts: float,
    events: list[KVEvent],
    spec: CacheSpec,
    layout: WireFormat,
    data_parallel_rank: int = 0,
) -> bytes:
    """One EventBatch payload: [ts, events, data_parallel_rank] as msgpack."""
    body = [ts, [wire_event(e, spec, layout) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)
