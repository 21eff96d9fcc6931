"""Adapter reads off the engine thread, each on a daemon thread of its own that ends with it.

Not a pool of threads that live on: reading an adapter runs torch ops (the float32 copy, the
finiteness check, the slices), and a thread that runs a parallel torch op gets an OpenMP team
of its own that lives as long as the thread. With more OpenMP threads than cores, libgomp
stops spinning between parallel regions and sleeps instead, which slows every op of the engine
thread (see AsyncEngine.from_config); a thread that ends takes its team with it. Daemon
threads, so that a read abandoned past its deadline never holds the process up at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from engine.daemon_pool import run_into


class ReadThreads(Executor):
    def __init__(self, max_running: int, name: str) -> None:
        """At most `max_running` reads run at once; the others wait their turn, on their own
        threads, until they are cancelled."""
        self._running = threading.BoundedSemaphore(max_running)
        self._name = name

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            with self._running:  # abandoned while it waited: run_into does nothing
                run_into(future, fn, args, kwargs)

        threading.Thread(target=run, name=self._name, daemon=True).start()
        return future
