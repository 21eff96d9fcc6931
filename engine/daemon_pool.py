"""A fixed pool of daemon threads behind the `Executor` interface.

concurrent.futures' threads are joined when the interpreter exits (and asyncio.run waits for
its default executor's, with no timeout), so one busy thread holds the process up however long
its work runs. Work here may be abandoned (a grammar compile past its deadline cannot be
interrupted), and a process that is done must still exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

BUSY_JOIN_SECONDS = 0.2


class DaemonThreadPool(Executor):
    def __init__(self, workers: int, name: str) -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple, dict] | None]
        self._work = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._work.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work: what still waits is cancelled, and each thread ends after what it
        runs now. With `wait`, idle threads are seen to end; one still busy is given a moment,
        then left to end on its own."""
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._workers:
            self._work.put(None)
        if wait:
            for worker in self._workers:
                worker.join(BUSY_JOIN_SECONDS)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            run_into(*item)
            # The next get() may wait for the rest of the process's life: nothing of the work
            # done may stay referenced from this frame meanwhile (an engine's step function
            # holds its weights and KV cache).
            del item


def run_into(future: Future[Any], fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Run `fn` for `future`, its result or exception handed over; nothing if it was cancelled."""
    if not future.set_running_or_notify_cancel():  # cancelled while it waited
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
        future.set_exception(exc)
