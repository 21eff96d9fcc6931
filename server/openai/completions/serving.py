"""POST /v1/completions: one engine request per prompt; choices in prompt-major order
(choice index = prompt index * n + sample index)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from config import ServerConfig
from engine import RequestOutput, SamplingParams
from engine.client import EngineRequest
from engine.outputs import CompletionOutput
from engine.processing.tokenization import decode, encode
from server.errors import invalid
from server.http.streaming import event_stream, merge, until_disconnected
from server.openai.completions.protocol import Completion, CompletionChoice, CompletionRequest
from server.openai.inputs import check_unicode, engine_params, submit
from server.openai.logprobs import add_completion_logprobs
from server.openai.protocol import CompletionLogprobs, Usage
from server.openai.stream_chunks import ChunkFrame, model_choice, text_choice
from server.openai.usage import RunningUsage
from server.state import ServerState


@dataclass
class PreparedPrompt:
    """One prompt of a completion request, checked and submitted (queued once read)."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams = field(init=False)
    outputs: AsyncGenerator[RequestOutput, None] = field(init=False)  # submitted, not yet queued


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [cast(list[int], prompt)]  # one prompt of token ids
    return list(cast(list[str] | list[list[int]], prompt))


def check_prompt_count(config: ServerConfig, prompts: int, n: int) -> None:
    """Each prompt costs tokenizing, checks and an engine request, each of its n samples a
    sequence and a choice: a request asks for at most --max-prompts-per-request of them, checked
    before any of that work is done."""
    limit = config.max_prompts_per_request
    if prompts * n <= limit:
        return
    if n == 1 or prompts > limit:
        raise invalid(
            f"the request holds {prompts} prompts, more than this server's limit of {limit} "
            "(--max-prompts-per-request)",
            "prompt",
        )
    raise invalid(
        f"{prompts} prompts with n={n} ask for {prompts * n} completions, more than this "
        f"server's limit of {limit} (--max-prompts-per-request counts each prompt n times)",
        "n",
    )


async def prepare_completion(
    state: ServerState, req: CompletionRequest, response_id: str
) -> list[PreparedPrompt]:
    raw = _split_prompts(req.prompt)
    check_prompt_count(state.config, len(raw), req.n)
    req.check()
    # A body of many prompts is a long walk: off the event loop, like the tokenizing below.
    await state.off_loop(check_unicode, req)
    if not raw:
        raise invalid("the prompt must not be empty", "prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise invalid("the prompt must not be empty", "prompt")
            prompts.append(
                PreparedPrompt(item, await state.off_loop(encode, state.tokenizer, item))
            )
        else:
            prompts.append(PreparedPrompt(None, list(item)))
    logprobs = req.logprobs
    structured, constraint_param = req.constraint() or (None, "")
    for p in prompts:
        p.params = engine_params(
            state,
            req,
            p.token_ids,
            req.max_tokens,
            "prompt",
            logprobs,
            prompt_logprobs=logprobs if req.echo else None,
            structured=structured,
        )
        await asyncio.sleep(0)  # one prompt's checks at a time: other requests run between
    # Every prompt submitted (checked, its grammar compiled) before any is queued.
    lora = state.lora_for(req.model)  # once: every prompt runs under the same adapter
    for i, p in enumerate(prompts):
        prompt = p.text if p.text is not None else p.token_ids
        p.outputs = await submit(
            state,
            EngineRequest(
                f"{response_id}-{i}",
                prompt,
                p.token_ids,
                p.params,
                req.priority,
                lora,
            ),
            constraint_param,
        )
        await asyncio.sleep(0)  # (a submit without a grammar to compile never yields by itself)
    return prompts


async def create_completion(
    state: ServerState, req: CompletionRequest, request: Request
) -> Completion | StreamingResponse:
    model = state.resolve_model(req.model)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = await prepare_completion(state, req, response_id)
    created = int(time.time())
    streams = [state.generate(request, p.outputs) for p in prompts]
    writer = _ChoiceWriter(state, req, prompts)
    if req.stream:
        return event_stream(_stream(writer, streams, response_id, created, model))

    async def collect() -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, output in merge(streams):
            finals[i] = output
        return [finals[i] for i in range(len(prompts))]

    finals = await until_disconnected(request, collect())
    choices = [writer.full_choice(i, c, out) for i, out in enumerate(finals) for c in out.outputs]
    return Completion(
        id=response_id, created=created, model=model, choices=choices, usage=Usage.of(finals)
    )


class _ChoiceWriter:
    """Turns engine outputs into choices: echo, logprobs and their text offsets."""

    def __init__(
        self, state: ServerState, req: CompletionRequest, prompts: list[PreparedPrompt]
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.offsets: dict[int, int] = {}  # streaming: text offset reached by each choice
        self.logprobs_sent: dict[int, int] = {}

    def index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.req.n + sample_index

    def _echo_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return (
            prompt.text
            if prompt.text is not None
            else decode(self.state.tokenizer, prompt.token_ids)
        )

    def _echo_logprobs(
        self, target: CompletionLogprobs, prompt_index: int, output: RequestOutput
    ) -> int:
        positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return add_completion_logprobs(
            target, self.state.tokenizer, output.prompt_token_ids, positions, 0
        )

    def full_choice(
        self, prompt_index: int, c: CompletionOutput, output: RequestOutput
    ) -> CompletionChoice:
        text = c.text
        logprobs = None
        offset = 0
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if self.req.echo:
                offset = self._echo_logprobs(logprobs, prompt_index, output)
            add_completion_logprobs(
                logprobs, self.state.tokenizer, c.token_ids, c.logprobs or [], offset
            )
        if self.req.echo:
            text = self._echo_text(prompt_index) + text
        return CompletionChoice(
            index=self.index(prompt_index, c.index),
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def delta_choice(
        self, prompt_index: int, c: CompletionOutput, output: RequestOutput
    ) -> str | None:
        """What is new for this choice since its last chunk, encoded, or None if nothing is."""
        index = self.index(prompt_index, c.index)
        first = index not in self.offsets
        text = c.text_delta
        logprobs = None
        offset = self.offsets.get(index, 0)
        if self.req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if first and self.req.echo:
                offset = self._echo_logprobs(logprobs, prompt_index, output)
            sent = self.logprobs_sent.get(index, 0)
            new = (c.logprobs or [])[sent:]
            offset = add_completion_logprobs(
                logprobs, self.state.tokenizer, c.token_ids[sent:], new, offset
            )
            self.logprobs_sent[index] = sent + len(new)
        if first and self.req.echo:
            text = self._echo_text(prompt_index) + text
        self.offsets[index] = offset
        if not text and not (logprobs and logprobs.tokens) and c.finish_reason is None:
            return None
        if logprobs is None:
            return text_choice(index, text, c.finish_reason, c.stop_reason)
        return model_choice(
            CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )


async def _stream(
    writer: _ChoiceWriter,
    streams: Sequence[AsyncIterator[RequestOutput]],
    response_id: str,
    created: int,
    model: str,
) -> AsyncGenerator[str, None]:
    frame = ChunkFrame(response_id, "text_completion", created, model, writer.req.include_usage)
    running = (
        RunningUsage(sum(len(p.token_ids) for p in writer.prompts), len(writer.prompts))
        if writer.req.continuous_usage
        else None
    )
    finals: dict[int, RequestOutput] = {}
    finished: set[int] = set()
    async for prompt_index, output in merge(streams):
        if running:
            running.saw(prompt_index, output)
        for c in output.outputs:
            index = writer.index(prompt_index, c.index)
            if index in finished:
                continue  # a sibling's output repeats this finished sample: nothing is new
            choice = writer.delta_choice(prompt_index, c, output)
            if choice is None:
                continue
            if c.finish_reason is not None:
                finished.add(index)
            usage = running.sent(index, len(c.token_ids)) if running else None
            yield frame.event([choice], usage)
        if output.finished:
            finals[prompt_index] = output
    if writer.req.include_usage:
        usage = Usage.of([finals[i] for i in range(len(writer.prompts))])
        yield frame.event([], usage)
