"""POST /v1/chat/completions: the conversation rendered with the model's chat template, then
one engine request with n samples."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine import RequestOutput
from engine.outputs import CompletionOutput
from server.inputs import chat_messages, compile_constraint, engine_params, render_chat
from server.logprobs import chat_logprobs
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Delta,
    Usage,
)
from server.state import ServerState
from server.streaming import event_stream, sse, until_disconnected
from server.usage import RunningUsage


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, request: Request
) -> ChatCompletion | StreamingResponse:
    model = state.resolve_model(req.model)
    req.check()
    constraint = req.constraint()
    messages = chat_messages(req.messages)
    prompt_ids = await state.off_loop(
        render_chat, state.tokenizer, messages, req.add_generation_prompt
    )
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    structured, constraint_param = constraint if constraint else (None, "")
    params = engine_params(state, req, prompt_ids, requested, "messages", top_n, None, structured)
    await compile_constraint(state, params, constraint_param)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = state.generate(request, prompt_ids, params, response_id, prompt_ids)

    def logprobs_of(c: CompletionOutput, token_ids: list[int], start: int) -> ChatLogprobs | None:
        if top_n is None:
            return None
        positions = (c.logprobs or [])[start : start + len(token_ids)]
        return ChatLogprobs(content=chat_logprobs(state.tokenizer, token_ids, positions, top_n))

    if req.stream:
        return event_stream(
            _stream(req, prompt_ids, stream, response_id, created, model, logprobs_of)
        )

    async def collect() -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None and final.finished
        return final

    final = await until_disconnected(request, collect())
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=logprobs_of(c, c.token_ids, 0),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    return ChatCompletion(
        id=response_id, created=created, model=model, choices=choices, usage=Usage.of([final])
    )


LogprobsOf = Callable[[CompletionOutput, list[int], int], ChatLogprobs | None]


async def _stream(
    req: ChatCompletionRequest,
    prompt_ids: list[int],
    stream: AsyncIterator[RequestOutput],
    response_id: str,
    created: int,
    model: str,
    logprobs_of: LogprobsOf,
) -> AsyncGenerator[str, None]:
    exclude = None if req.include_usage else {"usage"}
    running = RunningUsage(len(prompt_ids), 1) if req.continuous_usage else None

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=response_id, created=created, model=model, choices=choices, usage=usage
            ),
            exclude,
        )

    finished: set[int] = set()
    sent_tokens = [0] * req.n
    # The role comes first, in a delta of its own for every choice, as OpenAI sends it.
    for i in range(req.n):
        role = ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
        yield chunk([role], running.now() if running else None)
    final = None
    async for output in stream:
        final = output
        if running:
            running.saw(0, output)
        for c in output.outputs:
            if c.index in finished:
                continue  # a sibling's output repeats this finished sample: nothing is new
            logprobs = (
                logprobs_of(c, c.token_ids_delta, sent_tokens[c.index])
                if c.token_ids_delta
                else None
            )
            sent_tokens[c.index] += len(c.token_ids_delta)
            if not c.text_delta and logprobs is None and c.finish_reason is None:
                continue  # text held back (a partial character or stop string): nothing to show yet
            delta = Delta(content=c.text_delta) if c.text_delta else Delta()
            if c.finish_reason is not None:
                finished.add(c.index)
            choice = ChatChunkChoice(
                index=c.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            yield chunk([choice], running.sent(c.index, len(c.token_ids)) if running else None)
    if req.include_usage and final is not None:
        yield chunk([], Usage.of([final]))
