"""The publisher on its own: it never makes the engine thread wait, a full queue drops and
counts, the next batch that fits clears the subscribers' view, and replay follows vLLM's
protocol."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from config import KVEventsConfig
from engine.kv_events.events import BlockRemoved, BlockStored
from engine.kv_events.publisher import KVEventPublisher
from engine.kv_events.wire import CacheSpec
from tests.support.kv_events import Subscriber, free_tcp_endpoint, replay


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


def stored(i: int) -> BlockStored:
    return BlockStored([i.to_bytes(16, "big")], None, [i] * 4, 4)


def test_a_full_queue_drops_and_counts_and_the_next_batch_clears(ctx: zmq.Context) -> None:
    sub = Subscriber(ctx)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint, max_queue_size=2)
    publisher = KVEventPublisher(config, CacheSpec(4))
    sub.settle()
    gate = threading.Event()
    send = publisher._send

    def held(seq: int, payload: bytes) -> None:  # a publisher thread that cannot keep up
        gate.wait()
        send(seq, payload)

    publisher._send = held  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for i in range(10):
            publisher.publish([stored(i)])
        assert time.perf_counter() - start < 0.5  # the engine thread never waited
        # One batch is with the thread, two in the queue, seven dropped.
        assert publisher.num_enqueued + publisher.num_dropped == 10
        assert publisher.num_dropped >= 7
        assert publisher.take_dropped() == publisher.num_dropped
        assert publisher.take_dropped() == 0
    finally:
        gate.set()
    assert publisher.wait_published(publisher.num_enqueued, timeout=5)
    publisher.publish([BlockRemoved([(0).to_bytes(16, "big")])])  # the first that fits again
    assert publisher.wait_published(publisher.num_enqueued, timeout=5)
    sub.receive_until(publisher.num_enqueued - 1)
    last = sub.messages[-1][1][1]
    assert last[0] == ["AllBlocksCleared"] and last[1][0] == "BlockRemoved"
    publisher.close()
    sub.close()


def test_replay_answers_from_the_start_sequence_and_ends_with_minus_one(ctx: zmq.Context) -> None:
    endpoint, replay_at = free_tcp_endpoint(), free_tcp_endpoint()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=endpoint.replace("127.0.0.1", "*"),
        replay_endpoint=replay_at,
        buffer_steps=3,
    )
    publisher = KVEventPublisher(config, CacheSpec(4))
    for i in range(5):
        publisher.publish([stored(i)])
    assert publisher.wait_published(5, timeout=5)
    got = replay(ctx, replay_at, 3)
    assert [seq for seq, _ in got] == [3, 4]
    assert got[1][1][1] == [
        ["BlockStored", [4], None, [4] * 4, 4, None, "GPU", None, None, 0, "full_attention", None]
    ]
    # Only the last buffer_steps batches are kept.
    assert [seq for seq, _ in replay(ctx, replay_at, 0)] == [2, 3, 4]
    assert replay(ctx, replay_at, 9) == []
    # A malformed request is ignored and the socket keeps serving.
    bad = ctx.socket(zmq.DEALER)
    bad.connect(replay_at)
    bad.send_multipart([b"", b"xyz"])
    assert [seq for seq, _ in replay(ctx, replay_at, 4)] == [4]
    bad.close(0)
    publisher.close()
