"""The payload layouts, decoded with plain msgpack as a consumer would."""

from __future__ import annotations

import msgpack

from engine.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_events.wire import CacheSpec, encode_batch, external_hash

H1 = bytes(range(16))
H2 = bytes(range(100, 116))
TOP = b"\xff" * 16
EVENTS = [
    BlockStored([H1, H2], None, list(range(16)), 8),
    BlockStored([TOP], H2, [70000] * 8, 8),
    BlockRemoved([H1, TOP]),
    AllBlocksCleared(),
]


def decode(payload: bytes) -> list:
    return msgpack.unpackb(payload, raw=False)


def test_hashes_are_the_low_64_bits_as_unsigned_ints() -> None:
    assert external_hash(H1) == int.from_bytes(H1[8:], "big") == 0x08090A0B0C0D0E0F
    assert external_hash(TOP) == 2**64 - 1  # needs msgpack's uint64, not int64


def test_array_layout_is_positional_with_every_field() -> None:
    ts, events, rank = decode(encode_batch(12.5, EVENTS, CacheSpec(8), "array"))
    assert (ts, rank) == (12.5, 0)
    h1, h2, top = (external_hash(h) for h in (H1, H2, TOP))
    tail = [None, "GPU", None, None, 0, "full_attention", None]
    assert events == [
        ["BlockStored", [h1, h2], None, list(range(16)), 8, *tail],
        ["BlockStored", [top], h2, [70000] * 8, 8, *tail],
        ["BlockRemoved", [h1, top], "GPU", 0],
        ["AllBlocksCleared"],
    ]


def test_map_layout_names_fields_and_omits_unset_defaults() -> None:
    spec = CacheSpec(8, sliding_window=4096)
    _, events, _ = decode(encode_batch(1.0, EVENTS[1:], spec, "map"))
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [external_hash(TOP)],
        "parent_block_hash": external_hash(H2),
        "token_ids": [70000] * 8,
        "block_size": 8,
        "lora_id": None,  # no default in vLLM's struct: always written
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 4096,
    }  # extra_keys: None is its default, so it is left out
    assert events[1] == {
        "type": "BlockRemoved",
        "block_hashes": [external_hash(H1), external_hash(TOP)],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert events[2] == {"type": "AllBlocksCleared"}
