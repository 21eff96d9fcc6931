"""Start the daemon: the engine thread, then the HTTP server on the main thread's event loop."""

from __future__ import annotations

import logging

import uvicorn

from config import ServeConfig
from engine.async_engine import AsyncEngine
from server.app import create_app

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> None:
    engine = AsyncEngine.from_config(config.engine)
    engine.start()
    try:
        app = create_app(engine, config.server)
        server = config.server
        log.info("serving %s on http://%s:%d (max_model_len %d)", app.state.server.model_names[0], server.host, server.port,
                 engine.engine.max_model_len)
        uvicorn.run(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
