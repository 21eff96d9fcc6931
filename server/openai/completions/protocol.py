"""The bodies of `POST /v1/completions` (pydantic): the request and the completion it answers
with, whole or streamed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.openai.protocol import (
    CompletionLogprobs,
    Int,
    SamplingFields,
    Text,
    TokenId,
    Usage,
)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=5)
    echo: bool = False


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
