"""Which generation requests get in (those of routes declared with `GeneratingRoute`): none
once the server is draining for shutdown, and none while the queue is full. Both are refused at
once with 503, before the body is even read.

A request counts as *waiting* from its admission until its first token (or its end): that
covers the time it spends being tokenized and in the engine's queue, so a burst of a thousand
requests is bounded here, not after a thousand tokenizations. A request counts as *in flight*
until its response has been sent in full (a stream's last byte), which is what a drain waits
for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from server.errors import APIError

RETRY_AFTER_SECONDS = 1


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="service_unavailable")


@dataclass
class Ticket:
    """One admitted request; `start()` when its first token arrives."""

    gate: Gate
    started: bool = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.gate.waiting -= 1


@dataclass
class Gate:
    max_waiting: int | None = None
    on_reject: Callable[[str], None] | None = None  # metrics: called with the reason
    draining: bool = False
    waiting: int = 0
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def admit(self) -> Ticket:
        """A ticket for a new request, or the 503 that refuses it. Runs on the event loop, so
        check-and-count cannot race."""
        if self.draining:
            self.reject("shutting_down")
            raise shutting_down()
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            self.reject("queue_full")
            raise APIError(
                503,
                f"the server is at its limit of {self.max_waiting} waiting requests (--max-waiting-requests): "
                f"retry after {RETRY_AFTER_SECONDS} s",
                type="service_unavailable",
                code="queue_full",
            )
        self.waiting += 1
        self.in_flight += 1
        self._idle.clear()
        return Ticket(self)

    def release(self, ticket: Ticket) -> None:
        ticket.start()
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no admitted request is left in flight."""
        await self._idle.wait()

    def reject(self, reason: str) -> None:
        """Count a refusal: at the gate, or of an admitted request given up on (too long a wait)."""
        if self.on_reject is not None:
            self.on_reject(reason)


class GeneratingRoute(APIRoute):
    """The route class that declares a route as generating: its requests are admitted through
    the app's gate (`app.state.server.gate`) before the body is read, and hold their ticket (in
    the ASGI scope's state, where `ServerState.generate` finds it) until the response has been
    sent in full. Declare a route with `APIRouter(route_class=GeneratingRoute)`."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate: Gate = scope["app"].state.server.gate
        try:
            ticket = gate.admit()
        except APIError as refused:
            headers = (
                {"Retry-After": str(RETRY_AFTER_SECONDS)} if refused.code == "queue_full" else None
            )
            await refused.response(headers)(scope, receive, send)
            return
        scope.setdefault("state", {})["ticket"] = ticket
        try:
            await super().handle(scope, receive, send)
        finally:
            gate.release(ticket)
