"""Errors the engine raises, typed so the server can map each to an HTTP status."""


class InvalidRequestError(ValueError):
    """The request itself is invalid (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """The model cannot be loaded (missing folder, unsupported architecture): a start-up error."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped, so this request cannot be served. `failed` is true for a
    request that was in flight when a step raised (the server's fault: HTTP 500); false when
    the engine was already gone or shut down (unavailable: 503)."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class RequestFailedError(RuntimeError):
    """The engine failed this one request while stepping it (HTTP 500); the engine and every
    other request go on."""
