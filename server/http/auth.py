"""API-key check on /v1/*, as a plain ASGI middleware (so it never buffers a stream).
/health, /metrics and the rest stay open for probes and scrapers."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            # Anthropic's clients send the key as `x-api-key: KEY`.
            if b"x-api-key" in headers and not given:
                given = b"Bearer " + headers[b"x-api-key"]
            if not secrets.compare_digest(given, self.expected):
                message = (
                    "Incorrect API key provided."
                    if given
                    else "You didn't provide an API key: use 'Authorization: Bearer KEY' "
                    "(or 'x-api-key: KEY')."
                )
                error = APIError(401, message, code="invalid_api_key")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
