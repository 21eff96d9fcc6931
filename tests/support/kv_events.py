"""A KV-event subscriber for tests, written from the wire format alone (plain msgpack, the
positional layout llm-d's vLLM adapter reads): it never imports the publisher's code."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq


def free_port() -> int:
    """A TCP port nobody listens on now, on any interface (a plain socket: a ZMQ socket
    releases its port only later, on its I/O thread)."""
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


def free_tcp_endpoint() -> str:
    """A loopback endpoint nobody listens on now."""
    return f"tcp://127.0.0.1:{free_port()}"


def outward_address(family: socket.AddressFamily) -> str | None:
    """An address of this machine that is not loopback (the one it would reach the network
    from), or None where it has none. A UDP connect only picks a route: nothing is sent."""
    far = "198.51.100.1" if family == socket.AF_INET else "2001:db8::1"
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((far, 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") or address == "::1" else address


def has_ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (containers often run without IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def accepts_tcp(address: str, port: int) -> bool:
    """Whether something listens on address:port (a plain TCP connect, refused or not)."""
    try:
        with socket.create_connection((address, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


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
    """A SUB socket that binds (the publisher connects to it, as to llm-d's central picker),
    or, given `connect`, one that connects to a publisher that binds (llm-d's pod discovery)."""

    ctx: zmq.Context
    topic: bytes = b""
    endpoint: str = ""
    connect: str | None = None
    messages: list[tuple[int, list[Any]]] = field(default_factory=list)  # (seq, batch)

    def __post_init__(self) -> None:
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        if self.connect is not None:
            self.sock.setsockopt(zmq.IPV6, 1)
            self.sock.connect(self.connect)
            self.endpoint = self.connect
            return
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def first_message(self, send: Callable[[], None], timeout: float = 10.0) -> None:
        """Call `send` until a message arrives: a publisher drops what it sends before a newly
        connected subscriber's subscription reaches it, and nothing says when that is."""
        deadline = time.monotonic() + timeout
        while not self.messages:
            assert time.monotonic() < deadline, f"nothing arrived at {self.endpoint}"
            send()
            if self.sock.poll(100):
                self.take(self.sock.recv_multipart())

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
