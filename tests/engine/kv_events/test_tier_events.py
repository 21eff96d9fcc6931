"""KV events of the host offload tier, over real ZMQ: a subscriber that keeps one view per
`medium` rebuilds both the engine's pool ("GPU") and its host tier ("CPU") exactly, through a
workload whose revisits load from the tier and whose stores evict from it; every "CPU" store
carries its block's tokens."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import zmq

from engine import LLM, SamplingParams
from tests.support.kv_events import Subscriber, apply

BLOCK = 16
TOPIC = b"kv@pod-a@llama"
_rng = random.Random(0)
DOCS = [[_rng.randrange(1000, 20000) for _ in range(4 * BLOCK)] for _ in range(6)]
FIRST = [doc + [7, 8, 9] for doc in DOCS]
SECOND = [doc + [10, 11, 12] for doc in reversed(DOCS)]  # the newest first: still held
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# A pool of about two documents, a host tier of 12 blocks (4,096 bytes each): of the 24
# blocks the documents fill, half are evicted from the tier as the rest arrive.
ENGINE = {"max_model_len": 128, "block_size": BLOCK, "max_num_seqs": 2, "num_kv_blocks": 12}
HOST_GIB = 12 * 4096 / 2**30


def low64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def test_a_subscriber_rebuilds_the_pool_and_the_host_tier(llama_dir: Path) -> None:
    ctx = zmq.Context()
    sub = Subscriber(ctx, topic=TOPIC)
    config = {"enable_kv_cache_events": True, "endpoint": sub.endpoint, "topic": TOPIC.decode()}
    try:
        with LLM(
            str(llama_dir), kv_events_config=config, kv_offloading_size=HOST_GIB, **ENGINE
        ) as llm:
            publisher, offload = llm.engine.kv_events, llm.engine.offload
            assert publisher is not None and offload is not None
            sub.settle()
            llm.generate(FIRST, GREEDY)
            second = llm.generate(SECOND, GREEDY)
            assert sum(o.num_cached_tokens for o in second) > 0
            assert llm.last_run_stats.external_prefix_cache_hits > 0  # loaded from the tier
            sub.receive_until(publisher.num_enqueued - 1)
            pool = {low64(h) for h in llm.engine.kv.pool.cached_hashes()}
            host = {low64(h) for h in offload.host_block_hashes()}
    finally:
        sub.close()
        ctx.destroy(0)
    assert [seq for seq, _ in sub.messages] == list(range(len(sub.messages)))
    events = [e for _, batch in sub.messages for e in batch[1]]
    views: dict[str, set[int]] = defaultdict(set)
    for event in events:
        medium = {"BlockStored": 6, "BlockRemoved": 2}.get(event[0])
        for name in ("GPU", "CPU") if medium is None else (event[medium],):
            apply([event], views[name])  # AllBlocksCleared: every medium
    assert set(views) == {"GPU", "CPU"}
    assert views["GPU"] == pool and views["CPU"] == host
    assert len(host) == 12
    cpu_removed = [e for e in events if e[0] == "BlockRemoved" and e[2] == "CPU"]
    assert sum(len(e[1]) for e in cpu_removed) >= 12
    all_blocks = {tuple(doc[i * BLOCK : (i + 1) * BLOCK]) for doc in DOCS for i in range(4)}
    for event in events:
        if event[0] == "BlockStored" and event[6] == "CPU":
            assert len(event[1]) == 1 and tuple(event[3]) in all_blocks
