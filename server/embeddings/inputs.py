"""From the inputs of a pooling request to engine requests: split, tokenized (truncated where
asked), checked against the server's limits and the engine's, and submitted, all before any is
queued; then run to their embeddings, a client that leaves aborting the rest."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import torch
from fastapi import Request
from transformers import PreTrainedTokenizerBase

from engine import PoolingParams, PoolingRequestOutput
from engine.client import PoolingRequest
from engine.processing.tokenization import pooling_tokens, truncation
from server.errors import APIError, invalid
from server.http.streaming import merge, until_disconnected
from server.state import ServerState

RawInput = str | list[int]


def require_pooling(state: ServerState) -> None:
    """A generating model has no embeddings: refused by name, not with an engine error."""
    if state.engine.info.pooler is None:
        raise invalid(
            "this model generates text and has no embeddings: embeddings, score and rerank "
            "need a server started with --runner pooling on an embedding model",
            "model",
        )


def split_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[RawInput]:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]  # type: ignore[arg-type]  # one input of token ids
    return list(value)  # type: ignore[arg-type]


def check_count(state: ServerState, inputs: Sequence[object], field: str) -> None:
    limit = state.config.max_embedding_inputs
    if not inputs:
        raise invalid(f"{field} must not be an empty list", field)
    if len(inputs) > limit:
        raise invalid(
            f"{field} has {len(inputs)} items, more than this server's limit of {limit} "
            "(--max-embedding-inputs)",
            field,
        )


def _tokenize(
    tokenizer: PreTrainedTokenizerBase, inputs: list[RawInput], truncate: int | None
) -> list[list[int]]:
    """All inputs in one trip off the event loop."""
    return [pooling_tokens(tokenizer, item, truncate) for item in inputs]


@dataclass(frozen=True)
class Pooled:
    """The embeddings of a request's inputs, in order, and the tokens they took."""

    vectors: list[torch.Tensor]
    prompt_tokens: int


async def embed_inputs(
    state: ServerState,
    request: Request,
    request_id: str,
    inputs: list[RawInput],
    fields: list[str],
    truncate: int | None,
    params: PoolingParams,
) -> Pooled:
    """Embeds `inputs`; `fields[i]` is the request field input i came from, which its errors
    name (with its place in that field when the field holds several)."""
    places = [fields[:i].count(f) for i, f in enumerate(fields)]
    several = {f for f in fields if fields.count(f) > 1}

    def where(i: int) -> str:
        return f"{fields[i]} {places[i]}" if fields[i] in several else fields[i]

    for field, item in zip(fields, inputs):
        if isinstance(item, str) and not item:
            raise invalid(f"{field} must not hold an empty string", field)
    count = truncation(truncate, state.max_model_len)
    token_ids = await state.off_loop(_tokenize, state.tokenizer, inputs, count)
    limit = state.config.max_prompt_tokens
    submitted: list[AsyncGenerator[PoolingRequestOutput, None]] = []
    for i, (item, ids) in enumerate(zip(inputs, token_ids)):
        if limit is not None and len(ids) > limit:
            raise invalid(
                f"{where(i)} has {len(ids)} tokens, more than this server's limit of {limit} "
                "(--max-prompt-tokens)",
                fields[i],
            )
        submitted.append(
            await state.engine.submit_pooling(
                PoolingRequest(f"{request_id}-{i}", item, ids, params, fields[i])
            )
        )
    streams = [state.generate(request, s) for s in submitted]

    async def collect() -> list[PoolingRequestOutput]:
        finals: dict[int, PoolingRequestOutput] = {}
        async for i, output in merge(streams):
            finals[i] = output
        return [finals[i] for i in range(len(streams))]

    finals = await until_disconnected(request, collect())
    vectors = []
    for out in finals:
        if out.outputs is None:  # aborted: the engine is shutting down
            raise APIError(503, "the request was aborted", type="service_unavailable")
        vectors.append(out.outputs.data)
    return Pooled(vectors, sum(len(ids) for ids in token_ids))
