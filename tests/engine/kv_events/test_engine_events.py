"""KV events from a real engine over real ZMQ on loopback: a subscriber that knows only the
wire format rebuilds the set of cached blocks from the messages, and after a workload with
prefix hits, evictions and preemptions it is exactly the engine's own set; sequence numbers
have no gap, and replay hands back what a subscriber missed."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from config import ConfigError
from config import kv_events_config as kv_events_settings
from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import chain_hash
from tests.support.kv_events import (
    Subscriber,
    accepts_tcp,
    apply,
    free_port,
    free_tcp_endpoint,
    outward_address,
    replay,
)
from tests.support.prompts import cut_prompts, shared_prefix_prompts

BLOCK = 8
# Small blocks, a pool too small for all eight prompts at once, chunked prefill: preemption,
# prefix hits and evictions all happen (the same regime as the correctness test's "all").
ENGINE = {
    "block_size": BLOCK,
    "num_kv_blocks": 56,
    "max_num_batched_tokens": 24,
    "max_model_len": 384,
}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TOPIC = b"kv@pod-a@llama"


def low64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def engine_view(llm: LLM) -> set[int]:
    return {low64(h) for h in llm.engine.kv.pool.cached_hashes()}


def contiguous(messages: list[tuple[int, list]]) -> bool:
    seqs = [seq for seq, _ in messages]
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


def test_subscriber_rebuilds_the_engines_cache(llama_dir: Path, ctx: zmq.Context) -> None:
    sub = Subscriber(ctx, topic=TOPIC)
    replay_at = free_tcp_endpoint()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": sub.endpoint,  # no wildcard: connected to the subscriber, which binds
        "replay_endpoint": replay_at,
        "topic": TOPIC.decode(),
    }
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with LLM(str(llama_dir), kv_events_config=config, **ENGINE) as llm:
        publisher = llm.engine.kv_events
        assert publisher is not None
        sub.settle()
        shared = shared_prefix_prompts(tokenizer)
        llm.generate(shared, PARAMS)
        stats = llm.last_run_stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert llm.engine.kv.pool.num_evictions > 0
        sub.receive_until(publisher.num_enqueued - 1)
        seen = list(sub.messages)
        if seen[0][0] > 0:  # the connection came up after the first batch: fetch it back
            seen = replay(ctx, replay_at, 0)[: seen[0][0]] + seen
        assert [seq for seq, _ in seen] == list(range(publisher.num_enqueued))
        view: set[int] = set()
        for _, (ts, events, rank) in seen:
            assert isinstance(ts, float) and rank == 0
            apply(events, view)
        assert view == engine_view(llm) and view
        tags = {event[0] for _, batch in seen for event in batch[1]}
        assert tags == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
        assert seen[0][1][1][0] == ["AllBlocksCleared"]  # a fresh engine says so first

        # The first prompt's blocks, as the engine stored them in its first step: one event,
        # decoded by position as llm-d's vLLM adapter does, every field checked.
        first = next(e for _, b in seen for e in b[1] if e[0] == "BlockStored")
        prompt = shared[0]
        n = len(first[1])
        chain: list[bytes] = []
        for i in range(n):
            chain.append(
                chain_hash(chain[-1] if chain else b"", prompt[i * BLOCK : (i + 1) * BLOCK])
            )
        assert (
            first
            == [
                "BlockStored",
                [low64(h) for h in chain],  # block_hashes: uint64s
                None,  # parent_block_hash: the prompt's first block has none
                prompt[: n * BLOCK],  # token_ids
                BLOCK,  # block_size
                None,  # lora_id
                "GPU",  # medium: the engine's own pool
                None,  # lora_name
                None,  # extra_keys
                0,  # group_idx
                "full_attention",  # kv_cache_spec_kind
                None,  # kv_cache_spec_sliding_window
            ]
        )
        # Every later store of a run names its parent: a hash stored before it.
        stored_so_far: set[int] = set()
        for _, batch in seen:
            for event in batch[1]:
                if event[0] == "BlockStored":
                    assert event[2] is None or event[2] in stored_so_far
                    assert len(event[3]) == len(event[1]) * BLOCK
                    stored_so_far.update(event[1])

        # A subscriber that goes away misses a workload; replay from where it stopped gives
        # it every batch again, and its view is right once more.
        last = seen[-1][0]
        sub.close()
        evictions = llm.engine.kv.pool.num_evictions
        llm.generate(cut_prompts(tokenizer), PARAMS)
        assert llm.engine.kv.pool.num_evictions > evictions
        assert publisher.wait_published(publisher.num_enqueued, timeout=10)
        missed = replay(ctx, replay_at, last + 1)
        assert [seq for seq, _ in missed] == list(range(last + 1, publisher.num_enqueued))
        for _, (_, events, _) in missed:
            apply(events, view)
        assert view == engine_view(llm)
        assert publisher.num_dropped == 0


def test_unusable_endpoint_is_a_start_up_error_naming_the_flag(
    llama_dir: Path, ctx: zmq.Context
) -> None:
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        for endpoint in (f"tcp://*:{port}", "tcp://*:notaport", "bogus://x"):
            config = {"enable_kv_cache_events": True, "endpoint": endpoint}
            with pytest.raises(ConfigError, match="--kv-events-config") as err:
                LLM(str(llama_dir), kv_events_config=config, **ENGINE)
            assert endpoint in str(err.value)
    finally:
        taken.close(0)
    with pytest.raises(ConfigError, match=r"--kv-events-config.*unknown key 'endpont'"):
        LLM(str(llama_dir), kv_events_config='{"enable_kv_cache_events": true, "endpont": "x"}')
    with pytest.raises(ConfigError, match=r"--kv-events-config.*not valid JSON"):
        LLM(str(llama_dir), kv_events_config="{enable_kv_cache_events: true}")
    # With no prefix cache there is nothing to describe.
    config = {"enable_kv_cache_events": True, "endpoint": free_tcp_endpoint()}
    with pytest.raises(ConfigError, match=r"--kv-events-config.*prefix cache, which is off"):
        LLM(str(llama_dir), kv_events_config=config, enable_prefix_caching=False, **ENGINE)


def test_the_python_apis_default_endpoint_is_on_loopback_only(
    llama_dir: Path, ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No endpoint, no --host: a subscriber on this machine gets the events, and the port is
    not open on any other interface."""
    port = free_port()
    monkeypatch.setattr(kv_events_settings, "DEFAULT_PORT", port)
    with LLM(str(llama_dir), kv_events_config={"enable_kv_cache_events": True}, **ENGINE) as llm:
        publisher = llm.engine.kv_events
        assert publisher is not None
        assert publisher.address == f"tcp://127.0.0.1:{port}"
        sub = Subscriber(ctx, connect=f"tcp://127.0.0.1:{port}")
        firsts = itertools.count(10)
        # Each prompt new (two full blocks): each run stores blocks, so each sends events.
        sub.first_message(lambda: llm.generate([[next(firsts)] * (2 * BLOCK + 1)], PARAMS))
        assert any(event[0] == "BlockStored" for _, batch in sub.messages for event in batch[1])
        sub.close()
        outward = outward_address(socket.AF_INET)
        if outward is not None:
            assert not accepts_tcp(outward, port), (outward, port)
