"""A route is admitted through the queue gate because it is declared a GeneratingRoute, not
because its path is listed somewhere: a generating route added later is gated like the built-in
ones, and a plain route is not. In-process ASGI on the default engine."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import APIRouter, Request

from config import ServerConfig
from engine.async_engine import AsyncEngine
from server.app import create_app
from server.http.admission import GeneratingRoute


def test_a_declared_route_is_gated_and_a_plain_one_is_not(default_engine: AsyncEngine) -> None:
    app = create_app(default_engine, ServerConfig())
    gate = app.state.server.gate
    seen: list[tuple[str, bool, int]] = []
    extra = APIRouter(route_class=GeneratingRoute)

    @extra.post("/v1/new-generating-route")
    async def declared(request: Request) -> dict[str, bool]:
        seen.append(("declared", "ticket" in request.scope.get("state", {}), gate.in_flight))
        return {}

    @app.post("/v1/plain")
    async def plain(request: Request) -> dict[str, bool]:
        seen.append(("plain", "ticket" in request.scope.get("state", {}), gate.in_flight))
        return {}

    app.include_router(extra)

    async def post_both() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                (await client.post(path)).status_code
                for path in ("/v1/new-generating-route", "/v1/plain")
            ]

    assert asyncio.run(post_both()) == [200, 200]
    assert seen == [("declared", True, 1), ("plain", False, 0)]
    assert (gate.waiting, gate.in_flight) == (0, 0)  # the ticket was given back

    gate.draining = True  # refused at the gate now, before the handler runs
    seen.clear()
    assert asyncio.run(post_both()) == [503, 200]
    assert seen == [("plain", False, 0)]
