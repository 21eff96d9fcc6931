"""Disk reads ahead of the scheduler, off the engine thread. A request's prefix blocks that only
the disk tier holds are read as soon as the request arrives, while it waits in the queue; the
scheduler admits it once they are in memory, and the requests running meanwhile step on
without waiting for the disk. Read blocks are held until looked up, within a bound in bytes
(the oldest go first: a lookup that misses them reads the file itself)."""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict

import torch

from engine.kv_offload.disk_tier import DiskTier

_STOP = None


class DiskReader:
    def __init__(self, disk: DiskTier, max_held_bytes: int) -> None:
        self.disk = disk
        self.max_held_bytes = max_held_bytes
        self._held: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest first
        self._held_bytes = 0
        self._reading: set[bytes] = set()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._queue: queue.Queue[list[bytes] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-reader", daemon=True)
        self._thread.start()

    def request(self, keys: list[bytes]) -> None:
        """Read these blocks in the background (those not read or being read already)."""
        with self._lock:
            keys = [k for k in keys if k not in self._held and k not in self._reading]
            self._reading.update(keys)
        if keys:
            self._queue.put(keys)

    @property
    def busy(self) -> bool:
        """Whether any read is in flight (a set's emptiness: no lock needed to peek)."""
        return bool(self._reading)

    def reading(self, keys: list[bytes]) -> bool:
        with self._lock:
            return any(k in self._reading for k in keys)

    def wait(self, keys: list[bytes]) -> None:
        """Return once none of these blocks is being read."""
        with self._done:
            self._done.wait_for(lambda: not any(k in self._reading for k in keys))

    def take(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            block = self._held.pop(key, None)
            if block is not None:
                self._held_bytes -= block.numel() * block.element_size()
            return block

    def _run(self) -> None:
        while True:
            keys = self._queue.get()
            if keys is _STOP:
                return
            for key in keys:
                try:
                    block = self.disk.read(key)  # a bad file: a miss, as on the engine thread
                except Exception:  # noqa: BLE001 - the thread must outlive it: a miss
                    block = None
                with self._done:
                    self._reading.discard(key)
                    if block is not None:
                        self._hold(key, block)
                    self._done.notify_all()

    def _hold(self, key: bytes, block: torch.Tensor) -> None:
        """Keep a read block (lock held), dropping the oldest beyond the bound."""
        size = block.numel() * block.element_size()
        self._held[key] = block
        self._held_bytes += size
        while self._held_bytes > self.max_held_bytes and self._held:
            _, old = self._held.popitem(last=False)
            self._held_bytes -= old.numel() * old.element_size()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
