"""POST /v1/messages and /v1/messages/count_tokens: the request run as a chat request (the same
template, tokens, sampling, grammar, parsers and admission), its one sample's deltas shaped into
content blocks (`output.py`), whole or as Anthropic's event stream."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine import RequestOutput
from server.anthropic.errors import from_api_error
from server.anthropic.inputs import chat_request
from server.anthropic.output import BlockBuilder, stop_reason
from server.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessageDelta,
    MessageDeltaBody,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    OutputUsage,
    TokenCount,
)
from server.errors import as_api_error
from server.http.streaming import last_output, until_disconnected
from server.openai.chat.output import ChoiceShaper, ended_by_itself
from server.openai.chat.serving import prepare_chat, prompt_with_images
from server.openai.chat.tool_choice import plan_tools
from server.openai.inputs import check_unicode
from server.state import ServerState


def event(payload: BaseModel | dict) -> str:
    """One server-sent event as Anthropic sends them: its type named on an `event:` line."""
    if isinstance(payload, BaseModel):
        kind, body = payload.type, payload.model_dump_json()  # type: ignore[attr-defined]
    else:
        kind, body = payload["type"], json.dumps(payload)
    return f"event: {kind}\ndata: {body}\n\n"


async def count_tokens(state: ServerState, req: CountTokensRequest) -> TokenCount:
    """The prompt's tokens as `create_message` would render them (tools included)."""
    state.resolve_model(req.model)
    check_unicode(req)
    chat, names = chat_request(req)
    chat.check()
    plan = plan_tools(chat, state.tool_call_parser)  # the same refusals and prompt as a message's
    prompt_ids, _ = await prompt_with_images(state, chat, plan, names)  # images' spans count
    return TokenCount(input_tokens=len(prompt_ids))


async def create_message(
    state: ServerState, req: MessagesRequest, request: Request
) -> Message | StreamingResponse:
    model = state.resolve_model(req.model)
    check_unicode(req)
    message_id = f"msg_{uuid.uuid4().hex}"
    chat, names = chat_request(req)
    prepared = await prepare_chat(state, chat, message_id, names)
    outputs = state.generate(request, prepared.outputs)
    prompt_tokens = len(prepared.prompt_ids)
    if req.stream:
        events = _events(outputs, prepared.shaper(), message_id, model, prompt_tokens)
        return StreamingResponse(_with_errors(events), media_type="text/event-stream")
    final = (await until_disconnected(request, last_output(outputs))).outputs[0]
    builder = BlockBuilder()
    shaper = prepared.shaper()
    builder.feed(shaper.feed(final.text) + shaper.finish(ended_by_itself(final)))
    builder.close()
    reason, sequence = stop_reason(final, builder.called)
    return Message(
        id=message_id,
        model=model,
        content=builder.content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=MessageUsage(input_tokens=prompt_tokens, output_tokens=len(final.token_ids)),
    )


async def _events(
    outputs: AsyncIterator[RequestOutput],
    shaper: ChoiceShaper,
    message_id: str,
    model: str,
    prompt_tokens: int,
) -> AsyncGenerator[str, None]:
    usage = MessageUsage(input_tokens=prompt_tokens, output_tokens=0)
    start = Message(id=message_id, model=model, content=[], stop_reason=None, usage=usage)
    yield event(MessageStart(message=start))
    builder = BlockBuilder()
    final = None
    async for output in outputs:
        final = output.outputs[0]
        deltas = shaper.feed(final.text_delta)
        if final.finish_reason is not None:
            deltas += shaper.finish(ended_by_itself(final))
        for e in builder.feed(deltas):
            yield event(e)
    for e in builder.close():
        yield event(e)
    assert final is not None
    reason, sequence = stop_reason(final, builder.called)
    yield event(
        MessageDelta(
            delta=MessageDeltaBody(stop_reason=reason, stop_sequence=sequence),
            usage=OutputUsage(output_tokens=len(final.token_ids)),
        )
    )
    yield event(MessageStop())


async def _with_errors(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    # Once the first event is sent the status is 200 for good: a failure mid-stream (the engine
    # died) is told as Anthropic's `error` event, which its SDK raises.
    async with aclosing(events):  # closing it now aborts the engine request behind it
        try:
            async for e in events:
                yield e
        except Exception as exc:  # noqa: BLE001 - whatever failed, the client gets an error event
            yield event(from_api_error(as_api_error(exc)))
