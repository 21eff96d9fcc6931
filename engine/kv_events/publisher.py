"""The ZMQ publisher of KV events: a PUB socket, an optional ROUTER for replay, one thread.

The engine thread only hands a step's events to a bounded queue (`publish`); encoding and
sending happen on the publisher thread. A full queue drops the batch and counts it rather
than wait, and the next batch that fits starts with AllBlocksCleared, so a subscriber that
lost removals forgets what it thought was cached instead of routing to blocks long evicted.
A PUB socket never blocks on its subscribers: past the high-water mark ZMQ drops for the
slow one.

Replay (vLLM's protocol): a client sends [empty frame, start sequence (8 bytes, big-endian)]
to the ROUTER (a REQ or DEALER socket does that); it gets back one [empty, sequence, payload]
message per buffered batch from that sequence on, then [empty, -1 (8 bytes, signed), empty].
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from config import ConfigError, KVEventsConfig
from engine.kv_events.events import AllBlocksCleared, KVEvent
from engine.kv_events.wire import CacheSpec, encode_batch

log = logging.getLogger(__name__)

FLAG = "--kv-events-config"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def on_ipv6(endpoint: str) -> bool:
    """Whether a tcp:// address names an IPv6 host (`tcp://[::1]:5557`): ZMQ opens IPv6 only
    when told to, and fails on such an address otherwise."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return ":" in host


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, spec: CacheSpec) -> None:
        import zmq  # only a server that publishes events needs it

        self._zmq = zmq
        self._config = config
        self._spec = spec
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[float, list[KVEvent]]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._sent = threading.Condition()
        self.num_enqueued = 0  # batches handed to the publisher thread (engine thread only)
        self.num_dropped = 0  # batches dropped on a full queue (engine thread only)
        self._dropped_reported = 0
        self._resync = True  # the first batch tells subscribers to forget a previous run
        self._stop = threading.Event()
        # A socket used from another thread than its creator's is fine after a handover (the
        # thread start is the barrier): created here so that a bad endpoint fails start-up.
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        endpoint = config.address
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.IPV6, on_ipv6(endpoint))
            (self._pub.bind if config.binds else self._pub.connect)(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.IPV6, on_ipv6(config.replay_endpoint))
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(
                f"{FLAG}: cannot open the KV events socket ({exc}); endpoint "
                f"{endpoint!r}, replay_endpoint {config.replay_endpoint!r}"
            ) from None
        # What ZMQ resolved a bound address to (a host name, port 0), or the address connected to.
        self.address: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "KV events: publishing on %s (%s)",
            self.address,
            "bound" if config.binds else "connected to a subscriber that binds",
        )
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- the engine thread

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as one batch; never waits."""
        if not events and not self._resync:
            return
        if self._resync:
            events = [AllBlocksCleared(), *events]
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            self._resync = True
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning(
                    "KV events: %d batches dropped so far, the publisher queue (%d) is full",
                    self.num_dropped,
                    self._config.max_queue_size,
                )
            return
        self.num_enqueued += 1
        self._resync = False

    def take_dropped(self) -> int:
        """Batches dropped since the previous call (for the metrics)."""
        new = self.num_dropped - self._dropped_reported
        self._dropped_reported = self.num_dropped
        return new

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, waiting up to `timeout` seconds; the publisher thread closes the
        sockets as it ends (it alone uses them), so a port is freed even when the wait is cut."""
        self._stop.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------- the publisher thread

    @property
    def num_published(self) -> int:
        """Batches sent so far: the next sequence number."""
        return self._next_seq

    def wait_published(self, count: int, timeout: float) -> bool:
        """Wait until `count` batches are sent (tests, and a clean shutdown)."""
        with self._sent:
            return self._sent.wait_for(lambda: self._next_seq >= count, timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._close_sockets()

    def _loop(self) -> None:
        while True:
            try:
                self._serve_replay()
            except Exception:  # a bad replay client must not end publishing
                log.exception("KV events: could not answer a replay request")
            try:
                ts, events = self._queue.get(timeout=0.02)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                payload = encode_batch(ts, events, self._spec, self._config.wire_format)
                self._send(self._next_seq, payload)
            except Exception:  # an observer must not take the engine down: log and go on
                log.exception("KV events: could not publish a batch")
                continue
            self._buffer.append((self._next_seq, payload))
            with self._sent:
                self._next_seq += 1
                self._sent.notify_all()

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning(
                    "KV events: ignored a malformed replay request (%d frames)", len(frames)
                )
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
