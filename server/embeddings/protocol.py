"""The bodies of `POST /v1/embeddings` (pydantic), as OpenAI's API defines them, plus vLLM's
`truncate_prompt_tokens`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.openai.protocol import Int, Text, TokenId, _Request


class EmbeddingRequest(_Request):
    model: str | None = None
    # One text, texts, one input of token ids, or inputs of token ids (LangChain's default).
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's: keep at most this many tokens of each input (-1: the model's window).
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # float: the numbers; base64: little-endian float32 bytes, base64-encoded (as OpenAI does).
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
