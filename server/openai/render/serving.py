"""POST /v1/chat/completions/render and /v1/completions/render: the request prepared exactly as
its own route prepares it (template, tokens, limits, sampling, grammar: the same 400s), then
handed back instead of queued. `submit` queues a request only when its stream is first read, so
closing the unread stream leaves the engine untouched."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Response

from engine import SamplingParams
from server.errors import APIError, invalid
from server.openai.chat.images import image_parts
from server.openai.chat.protocol import ChatCompletionRequest
from server.openai.chat.serving import prepare_chat
from server.openai.completions.protocol import CompletionRequest
from server.openai.completions.serving import prepare_completion
from server.openai.inputs import check_unicode
from server.openai.render.protocol import RenderedRequest, sampling_fields
from server.state import ServerState


def _rendered(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    model: str,
    req: ChatCompletionRequest | CompletionRequest,
) -> RenderedRequest:
    return RenderedRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling_params=sampling_fields(params),
        model=model,
        stream=req.stream,
        stream_options=req.stream_options.model_dump() if req.stream_options else None,
        priority=req.priority,
    )


async def render_chat_request(state: ServerState, req: ChatCompletionRequest) -> RenderedRequest:
    model = state.resolve_model(req.model)
    check_unicode(req)
    images = image_parts(req.messages)
    if images:  # token ids alone would be run with placeholders where the images were
        raise invalid(
            "the render routes hand back token ids only, which cannot carry images",
            images[0].where,
        )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await prepare_chat(state, req, request_id)
    await prepared.outputs.aclose()
    return _rendered(request_id, prepared.prompt_ids, prepared.params, model, req)


# What a render answer may take: the token ids of a body's text need more bytes than the text
# (up to 7 a token: "49151,"), and each prompt carries its sampling parameters (~0.7 KB), so a
# body of natural text within --max-body-bytes renders to well under this; a body whose answer
# would not is refused, not serialized.
RESPONSE_BODY_FACTOR = 4


def _json_array(rendered: list[RenderedRequest], limit: int) -> bytes:
    """The answer as JSON bytes, built item by item (in a worker thread: a large one takes
    seconds of the interpreter) and refused as soon as it outgrows `limit`."""
    parts, size = [], 2
    for item in rendered:
        part = item.model_dump_json().encode()
        size += len(part) + 1
        if size > limit:
            raise APIError(
                400,
                f"the rendered requests take more than this server's limit of {limit} bytes "
                f"({RESPONSE_BODY_FACTOR} x --max-body-bytes): send fewer or shorter prompts",
                param="prompt",
                code="response_too_large",
            )
        parts.append(part)
    return b"[" + b",".join(parts) + b"]"


async def render_completion_request(state: ServerState, req: CompletionRequest) -> Response:
    model = state.resolve_model(req.model)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await prepare_completion(state, req, response_id)
    for p in prompts:
        await p.outputs.aclose()
    limit = RESPONSE_BODY_FACTOR * state.config.max_body_bytes

    def answer() -> bytes:
        rendered = [
            _rendered(f"{response_id}-{i}", p.token_ids, p.params, model, req)
            for i, p in enumerate(prompts)
        ]
        return _json_array(rendered, limit)

    # Not the tokenizer's thread: other requests' tokenizing need not wait for this.
    body = await asyncio.to_thread(answer)
    return Response(body, media_type="application/json")
