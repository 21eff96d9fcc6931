"""HTTP server settings: where to listen, who may call, what the model is called."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.engine_config import EngineConfig, _Strict

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


class ServerConfig(_Strict):
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    api_key: str | None = Field(
        None, repr=False, description="require 'Authorization: Bearer KEY' on /v1/*"
    )
    served_model_name: list[str] | None = Field(
        None, min_length=1, description="model names clients may ask for; the first is reported (default: MODEL)"
    )
    allowed_origins: list[str] = Field(["*"], description="CORS allowed origins")
    allowed_methods: list[str] = Field(["*"], description="CORS allowed methods")
    allowed_headers: list[str] = Field(["*"], description="CORS allowed headers")
    allow_credentials: bool = Field(False, description="CORS: allow credentials")
    uvicorn_log_level: LogLevel = Field("info", description="log level of the HTTP server")


class ServeConfig(_Strict):
    """Everything `pagedserve serve` runs with."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
