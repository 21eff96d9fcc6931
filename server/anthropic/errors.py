"""Errors on the Messages routes in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with the status codes its SDK maps to exception classes.

Every error the server answers (a 400 from validation, a 401 from the key check, a 429 or 503
from admission, a 404) is made in OpenAI's shape by the handlers the whole app shares; on these
routes a plain ASGI middleware rewrites the body of any error response, so that no source of
errors is missed and no stream is buffered (only error bodies are)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError

PATH = "/v1/messages"

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _message(error: dict[str, Any]) -> str:
    """The message, led by the field it names (Anthropic's shape has no `param`), as Anthropic
    words its own: `messages.0.content.1.type: ...`."""
    message, param = str(error.get("message")), error.get("param")
    return f"{param}: {message}" if param and not message.startswith(str(param)) else message


def from_api_error(error: APIError) -> dict[str, Any]:
    return anthropic_body(error.status, _message(error.body()["error"]))


def _reshaped(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message = _message(error) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):  # not an error object of ours: said as it is
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(anthropic_body(status, message)).encode()


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshape(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole (small) error body is here
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _reshaped(start["status"], b"".join(chunks))
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)
