"""Who runs the model for the engine: this process alone (`LocalExecutor`), or rank 0 here plus
spawned workers for ranks 1..N-1 (`TensorParallelExecutor`). Either way the engine hands over a
step's `HostBatch` and gets the logits back; the scheduler, block manager and sampler never
learn that ranks exist.

The workers and the process group are stopped by `close()` or, failing that, when the executor
is collected or the interpreter exits: a `weakref.finalize` holds only `_Ranks` (what stopping
needs), and the monitor thread holds the executor weakly, so nothing keeps a dropped engine
alive and a later tensor-parallel engine in this process can start its own group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from config import EngineConfig
from engine.distributed.shard import Shard
from engine.errors import ModelLoadError
from engine.kv_offload.connector import KVOffloadConnector
from engine.kv_offload.setup import make_kv_offload
from engine.loading.model_spec import ModelSpec
from engine.lora.checkpoint import LoRALoadError
from engine.lora.request import LoRARequest
from engine.lora.slots import PlacedAdapter
from engine.worker.model_input import HostBatch
from engine.worker.model_runner import build_runner
from engine.worker.tp_worker import (
    ALLOCATE_KV,
    FORGET_LORA,
    LOAD_LORA,
    READ_LORA,
    STEP,
    STOP,
    join_group,
    lora_message,
    message,
    worker_main,
)

log = logging.getLogger(__name__)

JOIN_SECONDS = 10.0
DEATH_NOTICE_SECONDS = 2.0  # for a peer's exit to show after its connection broke


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: no step can run any more."""


class LocalExecutor:
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.runner = build_runner(config, spec, Shard())
        self.on_failure: Callable[[], None] | None = (
            None  # never called: nothing here can die alone
        )

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks)

    def kv_offload(self, config: EngineConfig, spec: ModelSpec) -> KVOffloadConnector | None:
        """The KV offload tiers over the pool allocated (None without --kv-offloading-*)."""
        runner = self.runner
        return make_kv_offload(config, spec, lambda: runner.kv_caches)

    def execute(self, batch: HostBatch) -> torch.Tensor:
        logits = self.runner.execute(batch)
        assert logits is not None
        return logits

    def embed(self, batch: HostBatch) -> torch.Tensor:
        return self.runner.embed(batch)

    def capture_aux_hidden(self, layers: tuple[int, ...]) -> None:
        self.runner.capture_aux_hidden(layers)

    def aux_hidden(self) -> torch.Tensor:
        """The last step's inputs to the captured layers, one row per token computed."""
        assert self.runner.aux_hidden is not None, "no step ran since capture_aux_hidden()"
        return self.runner.aux_hidden

    def prepare_lora(self, request: LoRARequest) -> PlacedAdapter:
        return self.runner.prepare_lora(request)

    def read_lora(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None:
        self.runner.read_lora(request, prepared)

    def load_lora(self, slot: int, request: LoRARequest) -> None:
        self.runner.load_lora(slot, request)

    def forget_lora(self, request: LoRARequest) -> None:
        self.runner.forget_lora(request)

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection


@dataclass
class _Ranks:
    """Everything needed to stop the tensor-parallel ranks, and nothing that leads back to the
    executor or the engine: the finalizer and the monitor thread hold this."""

    workers: list[_Worker] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)
    failure: str | None = None
    group: dist.ProcessGroup | None = None  # rank 0's default group, once joined
    # Joining set this thread's torch thread count for rank 0's share of the cores; a thread's
    # count can only be set back from that thread.
    threads: tuple[threading.Thread, int] | None = None
    monitor: threading.Thread | None = None
    pid: int = field(default_factory=os.getpid)  # the process whose workers these are


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _describe_dead(ranks: _Ranks, timeout: float = 0.0) -> str | None:
    """Which workers are gone (waiting up to `timeout` for one to be); None if none is."""
    ended = wait([w.process.sentinel for w in ranks.workers], timeout)
    dead = [w for w in ranks.workers if w.process.sentinel in ended]
    for worker in dead:
        worker.process.join(JOIN_SECONDS)  # reaped, so that its exit status is known
    if dead:
        ranks.failure = ", ".join(
            f"tensor-parallel rank {w.rank} exited with status {w.process.exitcode}" for w in dead
        )
    return ranks.failure


def _watch(ranks: _Ranks, owner: weakref.ref[TensorParallelExecutor]) -> None:
    wait([w.process.sentinel for w in ranks.workers])
    # At interpreter exit multiprocessing terminates daemonic children before the finalizer
    # runs (its exit hook was registered first): an exit, not a failure.
    if ranks.closing.is_set() or not threading.main_thread().is_alive():
        return
    log.error("%s", _describe_dead(ranks))
    executor = owner()
    if executor is not None and executor.on_failure is not None:
        executor.on_failure()


def _stop_workers(ranks: _Ranks) -> None:
    for worker in ranks.workers:
        with contextlib.suppress(OSError):  # its end is closed: it is gone already
            worker.conn.send_bytes(STOP)
    for worker in ranks.workers:
        worker.process.join(JOIN_SECONDS)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def _shut_down(ranks: _Ranks) -> None:
    """Stop the workers, leave the process group and end the monitor thread. Runs once, from
    `close()`, the executor's collection (on whichever thread collects it) or interpreter exit."""
    if os.getpid() != ranks.pid:  # a forked child exiting: the workers are its parent's
        return
    ranks.closing.set()  # first, so that the monitor takes the workers' exits for a shutdown
    _stop_workers(ranks)
    # Only the group this executor made: the default group is per process, and destroying it is
    # what lets the next tensor-parallel engine here initialize its own.
    if ranks.group is not None and dist.is_initialized() and dist.group.WORLD is ranks.group:
        dist.destroy_process_group()
    if ranks.threads is not None and ranks.threads[0] is threading.current_thread():
        torch.set_num_threads(ranks.threads[1])
    monitor = ranks.monitor
    if monitor is not None and monitor is not threading.current_thread():
        monitor.join(JOIN_SECONDS)


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        if dist.is_initialized():  # else the workers would wait for a group that never forms
            raise ModelLoadError(
                "a torch.distributed process group already exists in this process: close the "
                "other tensor-parallel engine first"
            )
        size = config.parallel.tensor_parallel_size
        port = _free_port()
        context = mp.get_context("spawn")  # a fork would copy this process's threads and locks
        self.on_failure: Callable[[], None] | None = None  # called on the monitor thread
        self._ranks = _Ranks()
        self._finalizer = weakref.finalize(self, _shut_down, self._ranks)
        try:
            for rank in range(1, size):
                parent, child = context.Pipe()
                process = context.Process(
                    target=worker_main,
                    args=(config.model_dump_json(), spec, rank, port, child),
                    name=f"pagedserve-tp{rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                self._ranks.workers.append(_Worker(rank, process, parent))
            self.runner = build_runner(config, spec, Shard(0, size))
            self._wait_until_loaded()
            self._ranks.threads = (threading.current_thread(), torch.get_num_threads())
            join_group(config, spec, 0, port)
            self._ranks.group = dist.group.WORLD
        except BaseException:
            self._finalizer()
            raise
        log.info("tensor parallel: %d ranks (%s)", size, dist.get_backend())
        self._ranks.monitor = threading.Thread(
            target=_watch,
            args=(self._ranks, weakref.ref(self)),
            name="pagedserve-tp-monitor",
            daemon=True,
        )
        self._ranks.monitor.start()

    def _wait_until_loaded(self) -> None:
        """Every worker's shard loaded, or the first failure raised: a worker that dies first
        closes its end of the pipe, so start-up never waits on one that will not come."""
        for worker in self._ranks.workers:
            try:
                message = worker.conn.recv()
            except EOFError:
                worker.process.join(JOIN_SECONDS)
                message = f"exited with status {worker.process.exitcode}"
            if message != "loaded":
                raise ModelLoadError(
                    f"tensor-parallel rank {worker.rank} failed to start: {message}"
                )

    def check(self) -> None:
        if self._ranks.failure is not None:
            raise WorkerDiedError(self._ranks.failure)
        if not self._finalizer.alive:
            raise WorkerDiedError("the tensor-parallel workers were stopped: the engine is closed")

    def _send(self, data: bytes) -> None:
        self.check()
        for worker in self._ranks.workers:
            try:
                worker.conn.send_bytes(data)
            except OSError as exc:  # a worker's end of the pipe is closed: it is gone
                raise WorkerDiedError(
                    f"tensor-parallel rank {worker.rank} is gone: {exc}"
                ) from None

    def allocate_kv(self, num_blocks: int) -> None:
        self._send(message(ALLOCATE_KV, torch.tensor([num_blocks])))
        self.runner.allocate_kv(num_blocks)

    def kv_offload(self, config: EngineConfig, spec: ModelSpec) -> KVOffloadConnector | None:
        """Rank 0's tiers, which ask and tell the workers' (each made at ALLOCATE_KV)."""
        runner, channel = self.runner, _TierChannel(self)
        return make_kv_offload(
            config, spec, lambda: runner.kv_caches, Shard(0, channel.size), channel
        )

    def _answers(self, data: bytes) -> list[object]:
        """Send a message to every worker and receive each one's answer."""
        self._send(data)
        answers = []
        for worker in self._ranks.workers:
            try:
                answers.append(worker.conn.recv())
            except (EOFError, OSError):
                raise WorkerDiedError(
                    _describe_dead(self._ranks, timeout=DEATH_NOTICE_SECONDS)
                    or f"tensor-parallel rank {worker.rank} is gone"
                ) from None
        return answers

    def _ask(self, data: bytes) -> None:
        """Send an answered adapter message to every worker; LoRALoadError naming the first
        rank that could not serve it (each rank reads its own slice from the folder)."""
        refusals = []
        for worker, answer in zip(self._ranks.workers, self._answers(data)):
            if answer is not None:
                refusals.append(f"tensor-parallel rank {worker.rank}: {answer}")
        if refusals:
            raise LoRALoadError("; ".join(refusals))

    def prepare_lora(self, request: LoRARequest) -> PlacedAdapter:
        """Rank 0's slice, read and checked (on any thread): see ModelRunner.prepare_lora."""
        return self.runner.prepare_lora(request)

    def read_lora(self, request: LoRARequest, prepared: PlacedAdapter | None = None) -> None:
        """Every rank reads and keeps its slice now, when the adapter is added, so that a folder
        changed or removed later cannot fail one rank on first use. `prepared`: rank 0's slice,
        already read; the workers read their own from the folder (as files/read_regular_file
        reads them: no path can make a worker, and rank 0 waiting on it, hang)."""
        self.runner.read_lora(request, prepared)  # first: a bad adapter raises before any worker
        try:
            self._ask(lora_message(READ_LORA, request))
        except LoRALoadError:
            self.forget_lora(request)
            raise

    def load_lora(self, slot: int, request: LoRARequest) -> None:
        self.runner.load_lora(slot, request)  # first: a bad adapter raises before any worker
        self._ask(lora_message(LOAD_LORA, request, slot))

    def forget_lora(self, request: LoRARequest) -> None:
        self.runner.forget_lora(request)
        self._send(lora_message(FORGET_LORA, request))

    def embed(self, batch: HostBatch) -> torch.Tensor:
        raise RuntimeError(
            "pooling runs on one device (refused at start-up under tensor parallelism)"
        )

    def execute(self, batch: HostBatch) -> torch.Tensor:
        self._send(message(STEP, batch.pack()))
        try:
            logits = self.runner.execute(batch)
        except Exception as exc:
            # A collective fails when a peer dies: name the rank rather than the socket error.
            failure = _describe_dead(self._ranks, timeout=DEATH_NOTICE_SECONDS)
            if failure is not None:
                raise WorkerDiedError(failure) from exc
            raise
        assert logits is not None
        return logits

    def close(self) -> None:
        """Stop the workers and leave the process group; a second call does nothing."""
        self._finalizer()


@dataclass
class _TierChannel:
    """The KV offload tiers' messages to the workers (engine/kv_offload/tensor_parallel.py)."""

    executor: TensorParallelExecutor

    @property
    def size(self) -> int:
        return len(self.executor._ranks.workers) + 1

    def tell(self, kind: int, body: torch.Tensor) -> None:
        self.executor._send(message(kind, body))

    def ask(self, kind: int, body: torch.Tensor) -> list[object]:
        return self.executor._answers(message(kind, body))
