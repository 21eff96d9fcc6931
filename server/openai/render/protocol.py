"""The body the render routes answer: vLLM's `GenerateRequest` shape (what its tokens-in route
takes), which routers such as llm-d's token producer read `token_ids` from."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from engine import SamplingParams


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The parameters under vLLM's names (ours are vLLM's); the constraint as its JSON text."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    structured = params.structured_outputs
    if structured is not None:
        fields["structured_outputs"] = {
            k: v for k, v in dataclasses.asdict(structured).items() if v not in (None, False)
        }
    return fields


class RenderedRequest(BaseModel):
    request_id: str
    token_ids: list[int]
    features: dict[str, Any] | None = None  # multimodal placeholders: none for text
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
