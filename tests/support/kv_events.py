"""A KV-event subscriber for tests, written from the wire format alone (plain msgpack, the
positional layout llm-d's vLLM adapter reads): it never imports the publisher's code."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq


def free_tcp_endpoint() -> str:
    """A loopback endpoint nobody listens on now (a plain socket: a ZMQ socket releases its
    port only later, on its I/O thread)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def apply(events: list[Any], cached: set[int]) -> None:
    """Update a subscriber's view of the cached block hashes from one batch's events."""
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            cached.update(event[1])
        elif tag == "BlockRemoved":
            cached.difference_update(event[1])
        elif tag == "AllBlocksCleared":
            cached.clear()
        else:
            raise AssertionError(f"unknown event {tag!r}")


@dataclass
class Subscriber:
    """A SUB socket that binds (the publisher connects to it, as to llm-d's central picker)."""

    ctx: zmq.Context
    topic: bytes = b""
    endpoint: str = ""
    messages: list[tuple[int, list[Any]]] = field(default_factory=list)  # (seq, batch)

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def settle(self, seconds: float = 0.3) -> None:
        """Let the socket take in new connections: a SUB that binds sends its subscription to
        a publisher that connected only when the application next calls into it, and until
        then the publisher drops every message."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                self.take(self.sock.recv_multipart())

    def receive_until(self, last_seq: int, timeout: float = 10.0) -> None:
        """Take messages until the one numbered `last_seq` has arrived."""
        deadline = time.monotonic() + timeout
        while not self.messages or self.messages[-1][0] < last_seq:
            left = deadline - time.monotonic()
            assert left > 0, f"no message {last_seq} (last: {self.messages[-1:]})"
            if self.sock.poll(int(left * 1000)):
                self.take(self.sock.recv_multipart())

    def take(self, frames: list[bytes]) -> None:
        assert len(frames) == 3, f"expected [topic, seq, payload], got {len(frames)} frames"
        topic, seq, payload = frames
        assert topic == self.topic
        assert len(seq) == 8
        self.messages.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))

    def close(self) -> None:
        self.sock.close(0)


def replay(
    ctx: zmq.Context, endpoint: str, start: int, timeout: float = 10.0
) -> list[tuple[int, list[Any]]]:
    """Ask the replay socket for every batch from `start` on (vLLM's protocol): the replies
    up to, not including, the end marker (sequence -1)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(int(timeout * 1000)), "the replay socket did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert payload == b""
                return got
            got.append((number, msgpack.unpackb(payload, raw=False)))
    finally:
        sock.close(0)
