"""A ceiling on request bodies: a declared Content-Length over the limit is refused before a
byte is read; a chunked body is counted as it arrives and refused once it crosses the limit.
Either way the answer is 413 in OpenAI's error shape, and the body is never held in full."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError


def _message(limit: int) -> str:
    return (
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)"
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await APIError(413, _message(self.max_bytes)).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside the route's body parsing, which passes HTTPException through
                    # to the app's handler (anything else would become its generic 400).
                    raise HTTPException(413, _message(self.max_bytes))
            return message

        await self.app(scope, counted, send)
