"""POST /v1/responses and the stored responses' routes: a Responses request runs as the chat
request it maps to (`inputs.py`), its one choice is shaped into output items
(reasoning, message, function calls), and the response is kept in the store for
`previous_response_id`, retrieval and deletion."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import RequestOutput
from server.errors import CONTEXT_LENGTH_EXCEEDED, APIError, as_api_error, invalid
from server.http.streaming import last_output, until_disconnected
from server.openai.chat.output import ended_by_itself
from server.openai.chat.serving import PreparedChat, prepare_chat
from server.openai.inputs import check_unicode
from server.openai.parsers import reasoning_parser_for
from server.openai.responses.inputs import chat_request, input_messages, item_id, part_names
from server.openai.responses.output import OutputBuilder
from server.openai.responses.protocol import (
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseStateEvent,
    ResponseUsage,
)
from server.openai.responses.store import NoResponseStore, ResponseStore, StoredResponse
from server.state import ServerState


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id '{response_id}' is stored", code="not_found")


async def create_response(
    state: ServerState, store: ResponseStore, req: ResponsesRequest, request: Request
) -> JSONResponse | StreamingResponse:
    model = state.resolve_model(req.model)
    check_unicode(req)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if isinstance(store, NoResponseStore):
            raise invalid(
                "previous_response_id needs a response store (this server runs with "
                "--responses-store none)",
                "previous_response_id",
            )
        previous = await asyncio.to_thread(store.get, req.previous_response_id)
        if previous is None:
            raise invalid(
                f"Previous response with id '{req.previous_response_id}' not found.",
                "previous_response_id",
            )
        history = previous.messages
    messages, stored_items, origins = input_messages(req.input)
    conversation = history + messages
    response_id = item_id("resp")
    prepared = await _prepare(
        state, req, conversation, [None] * len(history) + origins, response_id
    )
    response = _skeleton(req, model, response_id)
    outputs = state.generate(request, prepared.outputs)
    run = _Run(state, store, req, prepared, response, conversation, stored_items)
    if req.stream:
        return StreamingResponse(run.events(outputs), media_type="text/event-stream")

    final = await until_disconnected(request, last_output(outputs))
    builder = OutputBuilder()
    shaper = prepared.shaper()
    c = final.outputs[0]
    builder.feed(shaper.feed(c.text) + shaper.finish(ended_by_itself(c)))
    builder.close()
    await run.finish(final, builder)
    return JSONResponse(response.model_dump(mode="json"))


# Chat parameters as the Responses fields they came from, for the errors a client reads.
_RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}
_CHAT_TOOL_FIELD = re.compile(r"^tools\.(\d+)\.function\.")


async def _prepare(
    state: ServerState,
    req: ResponsesRequest,
    conversation: list[dict[str, Any]],
    origins: list[str | None],
    response_id: str,
) -> PreparedChat:
    """The chat request prepared; with `truncation: auto`, the oldest turns of a conversation
    too long for the context are dropped (a tool output with the call it answers) until it
    fits or one message is left. `origins`: the input item of each message (None: an earlier
    response's), so that an error about a content part names it."""
    while True:
        try:
            names = part_names(conversation, origins, 1 if req.instructions else 0)
            return await prepare_chat(state, chat_request(req, conversation), response_id, names)
        except APIError as exc:
            fits = exc.code != CONTEXT_LENGTH_EXCEEDED  # (prompt and output budget together)
            if req.truncation != "auto" or fits or len(conversation) == 1:
                head = (exc.param or "").split(".")[0]
                if exc.param in _RESPONSES_PARAMS:  # a field nested differently here
                    exc.param = _RESPONSES_PARAMS[exc.param]
                elif head in _RESPONSES_PARAMS:
                    exc.param = _RESPONSES_PARAMS[head]
                elif exc.param is not None and _CHAT_TOOL_FIELD.match(exc.param):
                    # A function tool's fields sit beside its type here, not under `function`.
                    exc.param = _CHAT_TOOL_FIELD.sub(r"tools.\1.", exc.param)
                raise
            conversation, origins = conversation[1:], origins[1:]
            while len(conversation) > 1 and conversation[0]["role"] == "tool":
                conversation, origins = conversation[1:], origins[1:]


def _skeleton(req: ResponsesRequest, model: str, response_id: str) -> ResponseObject:
    """The response object before any output: the request's settings, echoed as OpenAI does."""
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=model,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        reasoning=req.reasoning.model_dump()
        if req.reasoning
        else {"effort": None, "summary": None},
        store=req.store,
        temperature=1.0 if req.temperature is None else req.temperature,
        text={"format": req.text_format()},
        tool_choice="auto"
        if req.tool_choice is None
        else (
            req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
        ),
        tools=req.tools or [],
        top_p=1.0 if req.top_p is None else req.top_p,
        truncation=req.truncation,
        user=req.user,
        metadata=req.metadata or {},
    )


class _Run:
    """One response being produced: its events (streaming), then its final state and storage."""

    def __init__(
        self,
        state: ServerState,
        store: ResponseStore,
        req: ResponsesRequest,
        prepared: PreparedChat,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
        stored_items: list[dict[str, Any]],
    ) -> None:
        self.state, self.store, self.req, self.prepared = state, store, req, prepared
        self.response = response
        self.conversation = conversation
        self.stored_items = stored_items
        self.sequence = 0

    def _sse(self, event: ResponseEvent) -> str:
        body = event.model_dump(mode="json")
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {event.type}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, outputs: AsyncIterator[RequestOutput]) -> AsyncGenerator[str, None]:
        yield self._sse(ResponseStateEvent(type="response.created", response=self.response))
        yield self._sse(ResponseStateEvent(type="response.in_progress", response=self.response))
        builder = OutputBuilder()
        shaper = self.prepared.shaper()
        try:
            async with aclosing(outputs):  # type: ignore[type-var]
                final = None
                async for output in outputs:
                    final = output
                    c = output.outputs[0]
                    deltas = shaper.feed(c.text_delta)
                    if c.finish_reason is not None:
                        deltas += shaper.finish(ended_by_itself(c))
                    for event in builder.feed(deltas):
                        yield self._sse(event)
            for event in builder.close():
                yield self._sse(event)
            assert final is not None
            await self.finish(final, builder)
        except Exception as exc:  # noqa: BLE001 - the client gets an error event, then a failed response
            error = as_api_error(exc)
            yield self._sse(ErrorEvent(code=error.code, message=error.message, param=error.param))
            self.response.status = "failed"
            self.response.error = ResponseError(
                code=error.code or "server_error", message=error.message
            )
            self.response.output = builder.output  # what was streamed before the failure
            yield self._sse(ResponseStateEvent(type="response.failed", response=self.response))
            return
        done = ResponseStateEvent(
            type="response.completed"
            if self.response.status == "completed"
            else "response.incomplete",
            response=self.response,
        )
        yield self._sse(done)

    async def finish(self, final: RequestOutput, builder: OutputBuilder) -> None:
        """Status, output and usage of the finished response; then it is stored."""
        c = final.outputs[0]
        response = self.response
        response.output = builder.output
        if c.finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            response.status = "completed"
        response.usage = self._usage(final)
        if not self.req.store or isinstance(self.store, NoResponseStore):
            return
        calls = [
            {
                "id": i.call_id,
                "type": "function",
                "function": {"name": i.name, "arguments": i.arguments},
            }
            for i in builder.output
            if isinstance(i, FunctionCallItem)
        ]
        reply: dict[str, Any] = {"role": "assistant", "content": builder.text or None}
        if calls:
            reply["tool_calls"] = calls
        stored = StoredResponse(
            id=response.id,
            created_at=time.time(),
            response=response.model_dump(mode="json"),
            input_items=self.stored_items,
            messages=self.conversation + [reply],
        )
        await asyncio.to_thread(self.store.put, stored)

    def _usage(self, final: RequestOutput) -> ResponseUsage:
        tokens = final.outputs[0].token_ids
        reasoning = 0
        name = self.prepared.reasoning_parser
        if name is not None:  # the tokens up to and with the end of the reasoning
            end = self.state.tokenizer.convert_tokens_to_ids(reasoning_parser_for(name).end)
            if end in tokens:
                reasoning = tokens.index(end) + 1
        prompt = len(final.prompt_token_ids)
        return ResponseUsage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
            output_tokens=len(tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=prompt + len(tokens),
        )


async def retrieve(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = await asyncio.to_thread(store.get, response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


def input_items_page(
    stored: StoredResponse,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
) -> InputItemList:
    """One page of the request's input items, as OpenAI pages them: in `order` (newest first
    by default), the `limit` items just after the item `after` (or just before `before`);
    `has_more` when items remain beyond the page in that direction."""
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for cursor, param in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise invalid(f"no input item {cursor!r} in response {stored.id!r}", param)
    start = ids.index(after) + 1 if after is not None else 0
    stop = ids.index(before) if before is not None else len(items)
    window = items[start:stop]
    # Before a cursor the page is the items nearest it; otherwise, the first ones.
    page = window[-limit:] if before is not None and after is None else window[:limit]
    return InputItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(window) > len(page),
    )
