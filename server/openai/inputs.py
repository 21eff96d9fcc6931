"""From an OpenAI request to what the engine takes: token ids and SamplingParams."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from config import ServerConfig
from engine import InvalidRequestError, RequestOutput, SamplingParams
from engine.client import EngineRequest
from engine.processing.tokenization import encode_chat
from engine.structured import SchemaError, StructuredOutputsParams
from server.errors import CONTEXT_LENGTH_EXCEEDED, APIError, invalid
from server.openai.protocol import ChatMessage, ContentPart, SamplingFields
from server.state import ServerState

# Where each way of giving a JSON schema holds the schema itself, for a 400 about its content.
SCHEMA_FIELDS = {
    "response_format": "response_format.json_schema.schema",
    "structured_outputs": "structured_outputs.json",
}


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """OpenAI's defaults where the request is silent (temperature 1, top_p 1, no penalties)."""

    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    return SamplingParams(
        n=req.n,
        # Beam search ranks raw logprobs: unset, the temperature is 0 there (vLLM's default).
        temperature=given(req.temperature, 0.0 if req.use_beam_search else 1.0),
        top_p=given(req.top_p, 1.0),
        top_k=req.top_k if req.top_k is not None else 0,
        min_p=given(req.min_p, 0.0),
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=given(req.presence_penalty, 0.0),
        frequency_penalty=given(req.frequency_penalty, 0.0),
        repetition_penalty=given(req.repetition_penalty, 1.0),
        # JSON keys are strings; SamplingParams turns them into token ids (or refuses them).
        logit_bias=req.logit_bias,  # type: ignore[arg-type]
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured,
        use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty,
        early_stopping=req.early_stopping,
    )


def check_limits(
    config: ServerConfig, n: int, prompt_len: int, requested: int | None, prompt_param: str
) -> None:
    """The server's own ceilings (flags), each refused with a message naming it."""
    if n > config.max_n:
        raise invalid(f"n={n} is more than this server's limit of {config.max_n} (--max-n)", "n")
    if config.max_prompt_tokens is not None and prompt_len > config.max_prompt_tokens:
        raise invalid(
            f"the prompt has {prompt_len} tokens, more than this server's limit of {config.max_prompt_tokens} "
            "(--max-prompt-tokens)",
            prompt_param,
        )
    if (
        config.max_output_tokens is not None
        and requested is not None
        and requested > config.max_output_tokens
    ):
        raise invalid(
            f"max_tokens={requested} is more than this server's limit of {config.max_output_tokens} (--max-output-tokens)",
            "max_tokens",
        )


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
    limit: int | None = None,
) -> int:
    """The completion budget: what was asked, which must fit beside the prompt, or (unasked)
    all the room the context has left, up to the server's `limit`."""
    room = max_model_len - prompt_len
    if requested is None and room >= 1:
        return room if limit is None else min(room, limit)
    wanted = requested if requested is not None else 1
    if prompt_len + wanted > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=prompt_param if room < 1 else "max_tokens",
            code=CONTEXT_LENGTH_EXCEEDED,  # OpenAI's code: clients (and truncation) look for it
        )
    return wanted


def _lone_surrogate(value: Any) -> tuple[str, int] | None:
    """The first string in `value` (keys included) that UTF-8 cannot carry: its path and the
    position of its lone surrogate; None when every string is text. Iterative: a body may nest
    as deep as the JSON parser allows."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                return where, exc.start
            continue
        if isinstance(node, dict):
            children = list(node.items())
        elif isinstance(node, list | tuple):
            children = list(enumerate(node))
        else:
            continue
        for key, child in reversed(children):  # popped in order
            name = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and _lone_surrogate(key) is not None:
                stack.append((key, where or name))  # a key that is no text: the field holding it
            else:
                stack.append((child, name))
    return None


def check_unicode(req: BaseModel) -> None:
    """A 400 naming the first field (ids, names, metadata, items, schemas: any string the request
    carries) that holds a lone surrogate, which JSON's \\ud800 escapes can deliver: no tokenizer
    takes one, no UTF-8 response or store can carry it."""
    found = _lone_surrogate(req.model_dump(by_alias=True, exclude_unset=True))
    if found is not None:
        where, position = found
        raise invalid(
            f"{where} must be valid Unicode text, not a lone surrogate at position {position}",
            where.encode("utf-8", "backslashreplace").decode(),
        )


def engine_params(
    state: ServerState,
    req: SamplingFields,
    prompt_ids: list[int],
    requested: int | None,
    prompt_param: str,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """One prompt's SamplingParams, or a 400: the server's limits and the completion budget
    (`requested` max tokens). The engine's own checks come with `submit`."""
    config = state.config
    check_limits(config, req.n, len(prompt_ids), requested, prompt_param)
    max_tokens = resolve_max_tokens(
        requested, len(prompt_ids), state.max_model_len, prompt_param, config.max_output_tokens
    )
    return sampling_params(req, max_tokens, logprobs, prompt_logprobs, structured)


async def submit(
    state: ServerState, request: EngineRequest, constraint_param: str = ""
) -> AsyncGenerator[RequestOutput, None]:
    """Hand one prompt to the engine, which checks it and compiles its grammar (off the event
    loop and the engine thread): a 400 before anything is queued, a grammar that does not
    compile naming `constraint_param`. The stream queues the request when first iterated."""
    try:
        return await state.engine.submit(request)
    except InvalidRequestError as exc:
        if exc.param == "structured_outputs" and constraint_param:
            if isinstance(exc, SchemaError):  # the message locates the keyword in the schema
                constraint_param = SCHEMA_FIELDS.get(constraint_param, constraint_param)
            raise invalid(str(exc), constraint_param) from None
        raise


def _tool_calls(message: ChatMessage, i: int, call_ids: set[str]) -> list[dict[str, Any]]:
    """An assistant's earlier calls as templates take them: arguments a JSON object (vLLM does
    the same), not the JSON text the API carries."""
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid(
                "a tool call's arguments must be a JSON object, as text",
                f"messages.{i}.tool_calls.{j}.function.arguments",
            )
        call_ids.add(call.id)
        calls.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return calls


def _parts(content: list[ContentPart], where: str, images: bool) -> str | list[dict[str, str]]:
    """Text parts joined into one string; or, for a model that reads images, the parts in
    order as transformers' chat templates take them (`{"type": "image"}` where an image goes:
    the template writes the model's placeholder there)."""
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and images:
            parts.append({"type": "image"})
        else:
            only = "text and image_url" if images else "only text"
            raise invalid(
                f"content part of type {part.type!r} is not supported: {only}", f"{where}.{j}"
            )
    return parts if images else "\n".join(p["text"] for p in parts)


def chat_messages(messages: list[ChatMessage], images: bool = False) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content a string (text parts joined) or, with
    `images` (a model that reads them), a list of text and image parts; the other fields of
    each message passed through; a tool message must answer an earlier call."""
    rendered = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        content: str | list[dict[str, str]] | None = (
            _parts(message.content, f"messages.{i}.content", images)
            if isinstance(message.content, list)
            else message.content
        )
        if message.tool_calls and message.role != "assistant":
            raise invalid(
                "only assistant messages may carry tool_calls", f"messages.{i}.tool_calls"
            )
        if message.role == "tool":
            if message.tool_call_id is None:
                raise invalid("a tool message needs tool_call_id", f"messages.{i}.tool_call_id")
            if message.tool_call_id not in call_ids:
                raise invalid(
                    f"tool_call_id {message.tool_call_id!r} answers no earlier assistant tool call",
                    f"messages.{i}.tool_call_id",
                )
        fields = message.model_dump(exclude_none=True)
        fields["content"] = content if content is not None else ""
        if message.tool_calls:
            fields["tool_calls"] = _tool_calls(message, i, call_ids)
        rendered.append(fields)
    return rendered


# Arguments of apply_chat_template itself, which chat_template_kwargs must not override.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation under the model's chat template (runs off the event loop)."""
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template: use /v1/completions", "messages")
    reserved = sorted(_TEMPLATE_ARGUMENTS & set(template_kwargs or {}))
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    try:
        return encode_chat(tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    except Exception as exc:  # noqa: BLE001 - a template's own raise_exception() (roles out of order) is any type
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
