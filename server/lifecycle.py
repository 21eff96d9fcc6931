"""How the daemon stops: drained on SIGTERM, at once on a second signal, non-zero when the
engine dies.

- First SIGTERM/SIGINT: the admission gate closes (new generation requests and /health get
  503, so a load balancer moves on), requests in flight get `shutdown_timeout` seconds to
  finish, then the engine aborts the rest (finish_reason `abort`; streams still end with
  `[DONE]`), their responses go out, and uvicorn stops. Exit status 0.
- A second signal during the drain: exit at once, status 128 + the signal's number.
- The engine thread dies (a step raised): every request in flight has already been failed by
  it; once those error responses are out, the server stops with status 1, so that an
  orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Generator
from contextlib import contextmanager
from types import FrameType

import uvicorn

from engine.client import EngineClient
from engine.daemon_pool import DaemonThreadPool
from server.http.admission import Gate

log = logging.getLogger(__name__)

ENGINE_POLL_SECONDS = 0.1
FLUSH_SECONDS = 10.0  # for responses still being sent once their requests have ended
# As many threads as asyncio's own default executor: store calls, the drain's engine shutdown.
IO_THREADS = min(32, (os.cpu_count() or 1) + 4)


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        engine: EngineClient,
        gate: Gate,
        shutdown_timeout: float,
        step_timeout: float = float("inf"),
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.gate = gate
        self.shutdown_timeout = shutdown_timeout
        self.step_timeout = step_timeout  # a step running longer counts as stuck
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = asyncio.Event()
        self._signalled = False

    def begin_drain(self) -> None:
        """Start the graceful shutdown; callable from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain_requested.set)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Replaces uvicorn's handlers, which would stop accepting at once. Only the main
        # thread can install signal handlers (a server run in a test thread is drained by
        # calling begin_drain).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        self._signalled = True
        log.info(
            "%s: draining (up to %.0f s for requests in flight)",
            signal.Signals(signum).name,
            self.shutdown_timeout,
        )
        self.begin_drain()

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        # asyncio.to_thread's threads: when the loop closes, one still busy is abandoned, not
        # waited for with no timeout, so that a drain ends within --shutdown-timeout.
        self._loop.set_default_executor(DaemonThreadPool(IO_THREADS, "pagedserve-io"))
        supervisor = asyncio.create_task(self._supervise())
        try:
            await super().serve(sockets)
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)

    async def _supervise(self) -> None:
        drain = asyncio.create_task(self._drain_requested.wait())
        try:
            while not drain.done() and self.engine.error is None:
                await asyncio.wait({drain}, timeout=ENGINE_POLL_SECONDS)
                if await self._stuck_for_good():
                    self.exit_code = 1
                    self.should_exit = True
                    return
        finally:
            drain.cancel()
        if self.engine.error is not None:
            log.error(
                "the engine has failed; stopping the server with status 1 so that it is restarted"
            )
            self.exit_code = 1
            self.gate.draining = True
            await self._wait_idle(FLUSH_SECONDS)
        else:
            await self._drain()
            if self.engine.error is not None:  # it failed while draining
                self.exit_code = 1
        self.should_exit = True

    async def _stuck_for_good(self) -> bool:
        """Whether the engine's step has run past --engine-step-timeout and then for a grace of
        --shutdown-timeout more (/health says 503 meanwhile): a kernel that never returns cannot
        be stopped from here, so the process exits for its supervisor to restart it."""
        stuck = self.engine.stuck_step(self.step_timeout)
        if stuck is None:
            return False
        log.error(
            "%s; exiting with status 1 in %.0f s unless it ends", stuck, self.shutdown_timeout
        )
        self.gate.draining = True
        deadline = asyncio.get_running_loop().time() + self.shutdown_timeout
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(ENGINE_POLL_SECONDS)
            if self.engine.stuck_step(self.step_timeout) is None:
                log.warning("the engine step has ended after all; serving again")
                self.gate.draining = self._drain_requested.is_set()
                return False
        log.error("the engine is still stuck: %s", self.engine.stuck_step(self.step_timeout))
        return True

    async def _drain(self) -> None:
        self.gate.draining = True
        if await self._wait_idle(self.shutdown_timeout):
            log.info("drained: every request in flight has finished")
            return
        log.warning(
            "shutdown timeout (%.0f s): aborting %d requests in flight",
            self.shutdown_timeout,
            self.gate.in_flight,
        )
        await asyncio.to_thread(
            self.engine.shutdown
        )  # aborts what is in flight, then stops the thread
        await self._wait_idle(FLUSH_SECONDS)

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.gate.wait_idle(), timeout)
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            return False
        return True
