"""Who runs the model for the engine: this process alone (`LocalExecutor`), or rank 0 here plus
spawned workers for ranks 1..N-1 (`TensorParallelExecutor`). Either way the engine hands over a
step's `HostBatch` and gets the logits back; the scheduler, block manager and sampler never
learn that ranks exist.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from config import EngineConfig
from engine.errors import ModelLoadError
from engine.model_input import HostBatch
from engine.model_runner import build_runner
from engine.parallel.shard import Shard
from engine.parallel.worker import ALLOCATE_KV, STEP, STOP, join_group, message, worker_main

log = logging.getLogger(__name__)

JOIN_SECONDS = 10.0
DEATH_NOTICE_SECONDS = 2.0  # for a peer's exit to show after its connection broke


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: no step can run any more."""


class LocalExecutor:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.loaded, self.runner = build_runner(config, Shard(), max_model_len)
        self.on_failure: Callable[[], None] | None = (
            None  # never called: nothing here can die alone
        )

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)

    def execute(self, batch: HostBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        assert logits is not None
        return logits

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        size = config.parallel.tensor_parallel_size
        port = _free_port()
        context = mp.get_context("spawn")  # a fork would copy this process's threads and locks
        self.workers: list[_Worker] = []
        self.failure: str | None = None
        self.on_failure: Callable[[], None] | None = None  # called on the monitor thread
        self._closing = False
        for rank in range(1, size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(config.model_dump_json(), rank, port, max_model_len, child),
                name=f"pagedserve-tp{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers.append(_Worker(rank, process, parent))
        try:
            self.loaded, self.runner = build_runner(config, Shard(0, size), max_model_len)
            self._wait_until_loaded()
        except BaseException:
            self._stop_workers()
            raise
        join_group(config, 0, port)
        log.info("tensor parallel: %d ranks (%s)", size, dist.get_backend())
        self._monitor = threading.Thread(
            target=self._watch, name="pagedserve-tp-monitor", daemon=True
        )
        self._monitor.start()

    def _wait_until_loaded(self) -> None:
        """Every worker's shard loaded, or the first failure raised: a worker that dies first
        closes its end of the pipe, so start-up never waits on one that will not come."""
        for worker in self.workers:
            try:
                message = worker.conn.recv()
            except EOFError:
                worker.process.join(JOIN_SECONDS)
                message = f"exited with status {worker.process.exitcode}"
            if message != "loaded":
                raise ModelLoadError(
                    f"tensor-parallel rank {worker.rank} failed to start: {message}"
                )

    def _watch(self) -> None:
        wait([w.process.sentinel for w in self.workers])
        if self._closing:
            return
        log.error("%s", self._describe_dead())
        if self.on_failure is not None:
            self.on_failure()

    def _describe_dead(self, timeout: float = 0.0) -> str | None:
        """Which workers are gone (waiting up to `timeout` for one to be); None if none is."""
        ended = wait([w.process.sentinel for w in self.workers], timeout)
        dead = [w for w in self.workers if w.process.sentinel in ended]
        for worker in dead:
            worker.process.join(JOIN_SECONDS)  # reaped, so that its exit status is known
        if dead:
            self.failure = ", ".join(
                f"tensor-parallel rank {w.rank} exited with status {w.process.exitcode}"
                for w in dead
            )
        return self.failure

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def _send(self, data: bytes) -> None:
        self.check()
        for worker in self.workers:
            try:
                worker.conn.send_bytes(data)
            except OSError as exc:  # a worker's end of the pipe is closed: it is gone
                raise WorkerDiedError(
                    f"tensor-parallel rank {worker.rank} is gone: {exc}"
                ) from None

    def allocate_kv(self, num_blocks: int) -> None:
        self._send(message(ALLOCATE_KV, torch.tensor([num_blocks])))
        self.runner.allocate_kv(num_blocks)

    def execute(self, batch: HostBatch) -> torch.Tensor:
        self._send(message(STEP, batch.pack()))
        try:
            logits = self.runner.execute(batch)
        except Exception as exc:
            # A collective fails when a peer dies: name the rank rather than the socket error.
            if self._describe_dead(timeout=DEATH_NOTICE_SECONDS) is not None:
                raise WorkerDiedError(self.failure) from exc
            raise
        assert logits is not None
        return logits

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_workers(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send_bytes(STOP)
            except OSError:
                pass
        for worker in self.workers:
            worker.process.join(JOIN_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
