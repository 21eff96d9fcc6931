"""POST /v1/chat/completions: the conversation (and its tools) rendered with the model's chat
template, then one engine request with n samples; each sample's text shaped into reasoning,
content and tool calls (`output.py`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine import RequestOutput, SamplingParams
from engine.client import EngineRequest
from engine.multimodal import MultiModalInputs
from engine.outputs import CompletionOutput
from engine.structured import StructuredOutputsParams
from server.http.streaming import event_stream, last_output, until_disconnected
from server.openai.chat.generic_tools import generic_messages
from server.openai.chat.images import (
    check_reads_images,
    expand_images,
    image_parts,
    load_images,
)
from server.openai.chat.output import ChoiceShaper, ended_by_itself, whole_message
from server.openai.chat.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Delta,
)
from server.openai.chat.tool_choice import ToolPlan, plan_tools
from server.openai.inputs import (
    chat_messages,
    check_unicode,
    engine_params,
    render_chat,
    submit,
)
from server.openai.logprobs import chat_logprobs
from server.openai.parsers import reasoning_parser_for
from server.openai.protocol import ChatLogprobs, Usage
from server.openai.stream_chunks import ChunkFrame, content_choice, model_choice
from server.openai.usage import RunningUsage
from server.state import ServerState


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready for the engine: what /v1/chat/completions and /v1/responses
    share (one engine path: the same prompt, parameters, grammar and parsers)."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    reasoning_parser: str | None
    outputs: AsyncGenerator[RequestOutput, None]  # submitted; queued when first iterated

    def shaper(self) -> ChoiceShaper:
        return ChoiceShaper.build(self.plan, self.reasoning_parser)


async def prepare_chat(
    state: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    part_names: Mapping[str, str] | None = None,
) -> PreparedChat:
    """Render, tokenize, check and submit a chat request (a 400 for anything wrong, with
    nothing queued). `part_names`: content parts' own names in another API's request."""
    req.check()
    plan = plan_tools(req, state.tool_call_parser)
    given = constraint = req.constraint()
    if plan.constraint is not None:
        # (In the generic format a JSON answer the request asks for is part of the grammar: an
        # error in its schema names the request's own field.)
        constraint = (plan.constraint, given[1] if given else "tools")
    prompt_ids, multi_modal = await prompt_with_images(state, req, plan, part_names)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    structured, constraint_param = constraint if constraint else (None, "")
    if structured is not None:
        structured = _after_reasoning(state, structured, prompt_ids)
    if plan.mode == "auto" and plan.parser in ("llama3_json", "mistral"):
        req.skip_special_tokens = False  # their markers (<|python_tag|>, [TOOL_CALLS]) are special
    params = engine_params(state, req, prompt_ids, requested, "messages", top_n, None, structured)
    outputs = await submit(
        state,
        EngineRequest(
            request_id,
            prompt_ids,
            prompt_ids,
            params,
            req.priority,
            state.lora_for(req.model),
            multi_modal,
        ),
        constraint_param,
    )
    return PreparedChat(prompt_ids, params, plan, state.config.reasoning_parser, outputs)


async def prompt_with_images(
    state: ServerState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    part_names: Mapping[str, str] | None = None,
) -> tuple[list[int], MultiModalInputs | None]:
    """The prompt's token ids, each image part's span expanded in them (usage counts these),
    and its images for the engine (None: a text prompt)."""
    parts = image_parts(req.messages, part_names)
    check_reads_images(state, parts)
    prompt_ids = await render_prompt(state, req, plan)
    if not parts:
        return prompt_ids, None
    images = await load_images(state, parts)
    return await expand_images(state, prompt_ids, images)


async def render_prompt(
    state: ServerState, req: ChatCompletionRequest, plan: ToolPlan
) -> list[int]:
    """The prompt's token ids: the conversation and its tools through the chat template (one
    placeholder per image part, not yet expanded)."""
    messages = chat_messages(req.messages, state.engine.info.accepts_images)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if plan.mode == "auto" and plan.parser == "generic" and req.tools:
        # The template knows no tools: they are told in a system message of ours instead.
        json_answer = req.constraint() is not None
        messages = generic_messages(messages, req.tools, req.parallel_tool_calls, json_answer)
        tools = None
    return await state.off_loop(
        render_chat,
        state.tokenizer,
        messages,
        req.add_generation_prompt,
        tools,
        req.chat_template_kwargs,
    )


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, request: Request
) -> ChatCompletion | StreamingResponse:
    model = state.resolve_model(req.model)
    check_unicode(req)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    prepared = await prepare_chat(state, req, response_id)
    prompt_ids, params = prepared.prompt_ids, prepared.params
    top_n = params.logprobs
    created = int(time.time())
    stream = state.generate(request, prepared.outputs)

    def logprobs_of(c: CompletionOutput, token_ids: list[int], start: int) -> ChatLogprobs | None:
        if top_n is None:
            return None
        positions = (c.logprobs or [])[start : start + len(token_ids)]
        return ChatLogprobs(content=chat_logprobs(state.tokenizer, token_ids, positions, top_n))

    if req.stream:
        return event_stream(
            _stream(
                req, prompt_ids, stream, response_id, created, model, logprobs_of, prepared.shaper
            )
        )

    final = await until_disconnected(request, last_output(stream))
    choices = []
    for c in final.outputs:
        message = whole_message(prepared.shaper(), c.text, ended_by_itself(c))
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=logprobs_of(c, c.token_ids, 0),
                finish_reason=_finish_reason(c, bool(message.tool_calls)),
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletion(
        id=response_id, created=created, model=model, choices=choices, usage=Usage.of([final])
    )


def _after_reasoning(
    state: ServerState, structured: StructuredOutputsParams, prompt_ids: list[int]
) -> StructuredOutputsParams:
    """With a reasoning parser, the constraint begins once the model closes its reasoning,
    unless the prompt already closed it (Qwen3 with enable_thinking false renders an empty
    <think></think> block at the end of the prompt)."""
    name = state.config.reasoning_parser
    if name is None:
        return structured
    end = state.tokenizer.convert_tokens_to_ids(reasoning_parser_for(name).end)
    if not isinstance(end, int) or end == state.tokenizer.unk_token_id or end in prompt_ids[-4:]:
        return structured
    return dataclasses.replace(structured, starts_after=end)


def _finish_reason(c: CompletionOutput, called: bool) -> str | None:
    # OpenAI: a turn that ended in tool calls finishes with "tool_calls".
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


LogprobsOf = Callable[[CompletionOutput, list[int], int], ChatLogprobs | None]


async def _stream(
    req: ChatCompletionRequest,
    prompt_ids: list[int],
    stream: AsyncIterator[RequestOutput],
    response_id: str,
    created: int,
    model: str,
    logprobs_of: LogprobsOf,
    shaper: Callable[[], ChoiceShaper],
) -> AsyncGenerator[str, None]:
    running = RunningUsage(len(prompt_ids), 1) if req.continuous_usage else None
    frame = ChunkFrame(response_id, "chat.completion.chunk", created, model, req.include_usage)

    finished: set[int] = set()
    sent_tokens = [0] * req.n
    shapers = [shaper() for _ in range(req.n)]
    # The role comes first, in a delta of its own for every choice, as OpenAI sends it.
    for i in range(req.n):
        role = ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
        yield frame.event([model_choice(role)], running.now() if running else None)
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
            shaping = shapers[c.index]
            deltas = shaping.feed(c.text_delta)
            if c.finish_reason is not None:
                finished.add(c.index)
                deltas += shaping.finish(ended_by_itself(c))
            if not deltas and logprobs is None and c.finish_reason is None:
                continue  # text held back (a partial character, stop string or marker)
            deltas = deltas or [Delta()]
            usage = running.sent(c.index, len(c.token_ids)) if running else None
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                finish_reason = _finish_reason(c, shaping.num_calls > 0) if last else None
                stop_reason = c.stop_reason if last else None
                if _content_only(delta) and (k > 0 or logprobs is None):
                    assert delta.content is not None
                    choice = content_choice(c.index, delta.content, finish_reason, stop_reason)
                else:
                    choice = model_choice(
                        ChatChunkChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=logprobs if k == 0 else None,
                            finish_reason=finish_reason,
                            stop_reason=stop_reason,
                        )
                    )
                yield frame.event([choice], usage)
    if req.include_usage and final is not None:
        yield frame.event([], Usage.of([final]))


def _content_only(delta: Delta) -> bool:
    return (
        delta.content is not None
        and delta.role is None
        and delta.reasoning_content is None
        and delta.tool_calls is None
    )
