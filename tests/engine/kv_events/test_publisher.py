"""The publisher on its own: it never makes the engine thread wait, a full queue drops and
counts, the next batch that fits clears the subscribers' view, replay follows vLLM's
protocol, and the socket is opened where the serve configuration says: by default on the
server's --host only."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import zmq

from config import ConfigError, KVEventsConfig
from config import kv_events_config as kv_events_settings
from config.sources import serve_config
from engine.kv_events.events import BlockRemoved, BlockStored
from engine.kv_events.publisher import KVEventPublisher
from engine.kv_events.wire import CacheSpec
from tests.support.kv_events import (
    Subscriber,
    accepts_tcp,
    free_port,
    free_tcp_endpoint,
    has_ipv6_loopback,
    outward_address,
    replay,
)


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


NEEDS_IPV6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")


def served_events(host: str, value: dict[str, object]) -> KVEventsConfig:
    """The events config `pagedserve serve --host HOST --kv-events-config VALUE` runs with."""
    config = serve_config({"host": host, "kv_events_config": json.dumps(value)}, {})
    events = config.engine.cache.kv_events_config
    assert events is not None
    return events


@pytest.mark.parametrize(
    ("host", "bound", "reach", "family", "everywhere"),
    [
        ("127.0.0.1", "127.0.0.1", "127.0.0.1", socket.AF_INET, False),
        ("localhost", "127.0.0.1", "127.0.0.1", socket.AF_INET, False),
        pytest.param("::1", "[::1]", "[::1]", socket.AF_INET6, False, marks=NEEDS_IPV6),
        ("0.0.0.0", "0.0.0.0", "127.0.0.1", socket.AF_INET, True),
        pytest.param("::", "[::]", "[::1]", socket.AF_INET6, True, marks=NEEDS_IPV6),
    ],
)
def test_the_default_endpoint_listens_on_the_servers_host_only(
    ctx: zmq.Context,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    bound: str,
    reach: str,
    family: socket.AddressFamily,
    everywhere: bool,
) -> None:
    port = free_port()
    monkeypatch.setattr(kv_events_settings, "DEFAULT_PORT", port)
    publisher = KVEventPublisher(
        served_events(host, {"enable_kv_cache_events": True}), CacheSpec(4)
    )
    try:
        # What ZMQ itself says it bound: the host's address, a wildcard only for a wildcard host.
        assert publisher.address == f"tcp://{bound}:{port}"
        sub = Subscriber(ctx, connect=f"tcp://{reach}:{port}")
        sub.first_message(lambda: publisher.publish([stored(1)]))
        sub.close()
        outward = outward_address(family)
        if outward is not None:  # this machine has another interface: is the port open there?
            assert accepts_tcp(outward, port) is everywhere, (outward, port)
    finally:
        publisher.close()


def test_a_named_endpoint_is_connected_to_as_vllm_does_whatever_the_host(
    ctx: zmq.Context,
) -> None:
    sub = Subscriber(ctx)  # binds, as a central subscriber does
    events = served_events("0.0.0.0", {"enable_kv_cache_events": True, "endpoint": sub.endpoint})
    publisher = KVEventPublisher(events, CacheSpec(4))
    try:
        assert publisher.address == sub.endpoint
        sub.first_message(lambda: publisher.publish([stored(2)]))
    finally:
        publisher.close()
        sub.close()


def test_bind_true_binds_one_named_interface(ctx: zmq.Context) -> None:
    endpoint = free_tcp_endpoint()  # 127.0.0.1: vLLM's rule alone would connect to it
    events = served_events(
        "0.0.0.0", {"enable_kv_cache_events": True, "endpoint": endpoint, "bind": True}
    )
    publisher = KVEventPublisher(events, CacheSpec(4))
    try:
        assert publisher.address == endpoint
        sub = Subscriber(ctx, connect=endpoint)
        sub.first_message(lambda: publisher.publish([stored(3)]))
        sub.close()
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("host", "endpoint"),
    [
        ("no-such-host.invalid", "tcp://no-such-host.invalid:{port}"),
        ("203.0.113.254", "tcp://203.0.113.254:{port}"),  # an address of no interface here
    ],
)
def test_a_host_events_cannot_bind_on_is_a_start_up_error(
    monkeypatch: pytest.MonkeyPatch, host: str, endpoint: str
) -> None:
    port = free_port()
    monkeypatch.setattr(kv_events_settings, "DEFAULT_PORT", port)
    with pytest.raises(ConfigError, match="--kv-events-config: cannot open") as err:
        KVEventPublisher(served_events(host, {"enable_kv_cache_events": True}), CacheSpec(4))
    assert endpoint.format(port=port) in str(err.value)
