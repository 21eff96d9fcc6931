"""Start the daemon: the engine thread, then the HTTP server on the main thread's event loop;
stop it as `server.lifecycle` describes and return the process's exit status."""

from __future__ import annotations

import logging
import os
import sys
import threading

import uvicorn
from tqdm import TMonitor

from config import ServeConfig
from engine.async_engine import AsyncEngine
from server.app import attach_metrics, create_app
from server.lifecycle import DrainingServer

log = logging.getLogger(__name__)

GRACEFUL_SECONDS = 5  # for uvicorn to close idle connections once the drain is over


def serve(config: ServeConfig) -> int:
    engine = AsyncEngine.from_config(config.engine)
    metrics = attach_metrics(engine, config.server)
    engine.start()
    settings = config.server
    try:
        app = create_app(engine, settings, metrics)
        log.info(
            "serving %s on http://%s:%d (max_model_len %d)",
            app.state.server.model_names[0],
            settings.host,
            settings.port,
            engine.info.max_model_len,
        )
        server = DrainingServer(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                log_level=settings.uvicorn_log_level,
                timeout_graceful_shutdown=GRACEFUL_SECONDS,
            ),
            engine,
            app.state.server.gate,
            settings.shutdown_timeout,
            settings.engine_step_timeout,
        )
        server.run()
    finally:
        engine.shutdown()
    if not server.started:
        log.error("the HTTP server did not start")
        return 1
    log.info("stopped (exit status %d)", server.exit_code)
    stop_progress_monitor()
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if left:
        log.warning("threads still running at exit: %s", [t.name for t in left])
        # The interpreter would join a non-daemon thread at exit, however long it runs, and a
        # daemon one stopped inside native code (an abandoned grammar compile) can abort the
        # exit: the drain's promise is to exit within its timeout, with its status.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code


def stop_progress_monitor() -> None:
    """tqdm starts a monitor thread with its first progress bar (transformers shows two while it
    converts the default model on a first start) and leaves it to the interpreter's exit: it is
    stopped here, idle, rather than reported as a thread left running."""
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()
