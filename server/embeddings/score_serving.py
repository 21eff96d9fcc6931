"""POST /v1/score and /v1/rerank from an embedding model: every text embedded (batched by the
scheduler like any embeddings request), each pair scored by the cosine similarity of its
embeddings."""

from __future__ import annotations

import time
import uuid

import torch
from fastapi import Request

from engine import PoolingParams
from server.embeddings.inputs import RawInput, check_count, embed_inputs, require_pooling
from server.embeddings.score_protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from server.errors import invalid
from server.state import ServerState


def _cosine(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


async def create_score(state: ServerState, req: ScoreRequest, request: Request) -> ScoreResponse:
    model = state.resolve_model(req.model, adapters=False)  # pooling: no LoRA
    require_pooling(state)
    first = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    second = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    check_count(state, first, "text_1")
    check_count(state, second, "text_2")
    if not all(first):
        raise invalid("text_1 must not hold an empty string", "text_1")
    if len(first) != 1 and len(first) != len(second):
        raise invalid(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2",
            "text_1",
        )
    inputs: list[RawInput] = [*first, *second]
    pooled = await embed_inputs(
        state,
        request,
        f"score-{uuid.uuid4().hex}",
        inputs,
        ["text_1"] * len(first) + ["text_2"] * len(second),
        req.truncate_prompt_tokens,
        PoolingParams(),
    )
    left = torch.stack(pooled.vectors[: len(first)])
    right = torch.stack(pooled.vectors[len(first) :])
    scores = _cosine(left.expand_as(right) if len(first) == 1 else left, right)
    return ScoreResponse(
        id=f"score-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=ScoreUsage(prompt_tokens=pooled.prompt_tokens, total_tokens=pooled.prompt_tokens),
    )


async def create_rerank(state: ServerState, req: RerankRequest, request: Request) -> RerankResponse:
    model = state.resolve_model(req.model, adapters=False)  # pooling: no LoRA
    require_pooling(state)
    check_count(state, req.documents, "documents")
    if not req.query:
        raise invalid("query must not be empty", "query")
    inputs: list[RawInput] = [req.query, *req.documents]
    pooled = await embed_inputs(
        state,
        request,
        f"rerank-{uuid.uuid4().hex}",
        inputs,
        ["query"] + ["documents"] * len(req.documents),
        req.truncate_prompt_tokens,
        PoolingParams(),
    )
    query = pooled.vectors[0]
    docs = torch.stack(pooled.vectors[1:])
    scores = _cosine(query.expand_as(docs), docs)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep input order
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    return RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}",
        model=model,
        usage=RerankUsage(total_tokens=pooled.prompt_tokens),
        results=results,
    )
