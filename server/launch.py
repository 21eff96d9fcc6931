"""Start the daemon: the engine thread, then the HTTP server on the main thread's event loop."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from config import ServeConfig
from engine.async_engine import AsyncEngine
from server.app import attach_metrics, create_app

log = logging.getLogger(__name__)


def _stopped_by_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve(config: ServeConfig) -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler
    # it found at start. Finding this one, a requested stop ends with status 0, engine joined.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped_by_signal)
    engine = AsyncEngine.from_config(config.engine)
    registry = attach_metrics(engine, config.server)
    engine.start()
    try:
        app = create_app(engine, config.server, registry)
        server = config.server
        log.info("serving %s on http://%s:%d (max_model_len %d)", app.state.server.model_names[0], server.host, server.port,
                 engine.engine.max_model_len)
        uvicorn.run(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
