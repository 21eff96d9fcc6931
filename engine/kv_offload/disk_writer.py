"""Disk writes off the engine thread. A block handed over stays readable from memory until its
file is in place, so a lookup never misses a block only because its write is still queued;
the queue is bounded in bytes, and a block that would overflow it is not written (counted)."""

from __future__ import annotations

import queue
import threading

import torch

from engine.kv_offload.block_io import StoredBlocks
from engine.kv_offload.disk_tier import DiskTier

_STOP = None


class DiskWriter:
    def __init__(self, disk: DiskTier, max_pending_bytes: int) -> None:
        self.disk = disk
        self.max_pending_bytes = max_pending_bytes
        self.num_dropped = 0
        self._pending: dict[bytes, torch.Tensor] = {}
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[list[bytes], StoredBlocks] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def pending(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            return self._pending.get(key)

    def submit(self, keys: list[bytes], stored: StoredBlocks) -> None:
        taken: list[bytes] = []
        with self._lock:
            for key, block in zip(keys, stored.blocks):
                size = block.numel() * block.element_size()
                if key in self._pending:
                    continue
                if self._pending_bytes + size > self.max_pending_bytes:
                    self.num_dropped += 1
                    continue
                self._pending[key] = block
                self._pending_bytes += size
                taken.append(key)
        if taken:
            self._queue.put((taken, stored))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                keys, stored = item
                stored.wait()
                for key in keys:
                    block = self._pending[key]
                    if self.disk.enabled:
                        try:
                            self.disk.write(key, block)
                        except Exception as exc:  # noqa: BLE001 - the thread must outlive it
                            self.disk.disable(f"writing a block failed: {exc!r}")
                    with self._lock:
                        del self._pending[key]
                        self._pending_bytes -= block.numel() * block.element_size()
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Return once every block handed over is written (or dropped by a failing disk)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()
