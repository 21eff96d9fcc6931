"""The pooling routes, admitted through the same gate as the generating ones (queue limit,
drain, the wait until the first result)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.embeddings.protocol import EmbeddingRequest, EmbeddingResponse
from server.embeddings.score_protocol import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.embeddings.score_serving import create_rerank, create_score
from server.embeddings.serving import create_embedding
from server.http.admission import GeneratingRoute
from server.state import ServerState


def pooling_router(
    state: ServerState,
    before: Callable[[BaseModel], None],
) -> APIRouter:
    """`before` runs first on every request body (the app's checks: unread fields logged,
    the engine alive)."""
    router = APIRouter(route_class=GeneratingRoute)

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        before(req)
        return await create_embedding(state, req, request)

    @router.post("/v1/score")
    @router.post("/score")
    async def score(req: ScoreRequest, request: Request) -> ScoreResponse:
        before(req)
        return await create_score(state, req, request)

    @router.post("/v1/rerank")
    @router.post("/rerank")
    @router.post("/v2/rerank")
    async def rerank(req: RerankRequest, request: Request) -> RerankResponse:
        before(req)
        return await create_rerank(state, req, request)

    return router
