"""Errors the engine raises, typed so the server can map each to an HTTP status."""


class InvalidRequestError(ValueError):
    """The request itself is invalid (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """The model cannot be loaded (missing folder, unsupported architecture): a start-up error."""
