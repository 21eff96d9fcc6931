"""POST /v1/chat/completions/render and /v1/completions/render: the request prepared exactly as
its own route prepares it (template, tokens, limits, sampling, grammar: the same 400s), then
handed back instead of queued. `submit` queues a request only when its stream is first read, so
closing the unread stream leaves the engine untouched."""

from __future__ import annotations

import uuid

from engine import SamplingParams
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
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await prepare_chat(state, req, request_id)
    await prepared.outputs.aclose()
    return _rendered(request_id, prepared.prompt_ids, prepared.params, model, req)


async def render_completion_request(
    state: ServerState, req: CompletionRequest
) -> list[RenderedRequest]:
    model = state.resolve_model(req.model)
    check_unicode(req)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await prepare_completion(state, req, response_id)
    rendered = []
    for i, p in enumerate(prompts):
        await p.outputs.aclose()
        rendered.append(_rendered(f"{response_id}-{i}", p.token_ids, p.params, model, req))
    return rendered
