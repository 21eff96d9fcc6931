"""The bodies of `POST /v1/score` and `POST /v1/rerank` in vLLM's shapes (the rerank request
takes Jina's and Cohere's fields: `query`, `documents`, `top_n`, `return_documents`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.openai.protocol import Int, Text, _Request


class ScoreRequest(_Request):
    model: str | None = None
    # One text against one or many (1:N), or pairwise (N:N).
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(_Request):
    model: str | None = None
    query: Text
    documents: list[Text]
    top_n: Int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
