"""POST /v1/embeddings: one engine request per input, all batched by the scheduler."""

from __future__ import annotations

import base64
import uuid

import torch
from fastapi import Request

from engine import PoolingParams
from server.embeddings.inputs import check_count, embed_inputs, require_pooling, split_inputs
from server.embeddings.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from server.state import ServerState


def encode_base64(vector: torch.Tensor) -> str:
    """OpenAI's base64 form: the float32 values' little-endian bytes."""
    return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")


async def create_embedding(
    state: ServerState, req: EmbeddingRequest, request: Request
) -> EmbeddingResponse:
    model = state.resolve_model(req.model, adapters=False)  # pooling: no LoRA
    require_pooling(state)
    inputs = split_inputs(req.input)
    check_count(state, inputs, "input")
    pooled = await embed_inputs(
        state,
        request,
        f"embd-{uuid.uuid4().hex}",
        inputs,
        ["input"] * len(inputs),
        req.truncate_prompt_tokens,
        PoolingParams(dimensions=req.dimensions),
    )
    data = [
        Embedding(
            index=i,
            embedding=encode_base64(v) if req.encoding_format == "base64" else v.tolist(),
        )
        for i, v in enumerate(pooled.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=pooled.prompt_tokens, total_tokens=pooled.prompt_tokens)
    return EmbeddingResponse(data=data, model=model, usage=usage)
