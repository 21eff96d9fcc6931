"""An Anthropic Messages request as the chat request it runs as: the system prompt and the
content blocks become chat messages (tool_use blocks an assistant's tool_calls, tool_result
blocks tool messages, image blocks image parts), the tools and tool_choice their chat forms. What
cannot be served (documents, server tools, extended thinking; images for a model that reads
none) is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from server.anthropic.protocol import CountTokensRequest, MessagesRequest, Tool
from server.errors import invalid
from server.openai.chat.protocol import ChatCompletionRequest
from server.openai.protocol import Text, _Request


class TextIn(_Request):
    text: Text


class Base64Source(_Request):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]  # Anthropic's
    data: str


class URLSource(_Request):
    type: Literal["url"]
    url: str


class ImageIn(_Request):
    source: Base64Source | URLSource = Field(discriminator="type")


class ToolUseIn(_Request):
    id: Text
    name: Text
    input: dict[str, Any]


class ToolResultIn(_Request):
    tool_use_id: Text
    content: Text | list[dict[str, Any]] = ""
    is_error: bool = False


# An assistant's earlier reasoning: the chat template renders none of it, as for chat messages.
SKIPPED_IN_HISTORY = {"thinking", "redacted_thinking"}


def _parse(model: type[_Request], block: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(block)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join([where, *(str(p) for p in first["loc"] if p != "str")])
        raise invalid(f"{path}: {first['msg']}", path) from None


def _text(block: dict[str, Any], where: str) -> str:
    """A text block's text. Anthropic refuses an empty one wherever it stands (a final
    assistant message included: an empty prefill is no content, not an empty block)."""
    text: str = _parse(TextIn, block, where).text
    if not text:
        raise invalid("text content blocks must be non-empty", f"{where}.text")
    return text


def _unsupported(kind: object, where: str) -> Exception:
    return invalid(f"content blocks of type {kind!r} are not supported here", f"{where}.type")


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks joined (a system prompt, a tool result): anything else is refused."""
    parts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise _unsupported(block.get("type"), f"{where}.{j}")
        parts.append(_text(block, f"{where}.{j}"))
    return "\n".join(parts)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as the chat image part it runs as: inline data becomes a data: URL, so
    that both sources load (and are limited) alike."""
    source = _parse(ImageIn, block, where).source
    if isinstance(source, Base64Source):
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _user(content: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Tool results first, as tool messages (Anthropic puts them first in the turn), then the
    text as one user message: its text joined, or, with images, its text and image parts in
    order. Also the block each of those parts came from."""
    results, parts, blocks = [], [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.{j}"
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
            blocks.append(at)
        elif kind == "image":
            parts.append(_image(block, at))
            blocks.append(at)
        elif kind == "tool_result":
            result = _parse(ToolResultIn, block, at)
            text = (
                result.content
                if isinstance(result.content, str)
                else _texts(result.content, f"{at}.content")
            )
            if result.is_error:  # the model should know the call failed, not only what it said
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": text})
        else:
            raise _unsupported(kind, at)
    if not parts:
        return results, []
    if all(part["type"] == "text" for part in parts):
        return results + [{"role": "user", "content": "\n".join(p["text"] for p in parts)}], []
    return results + [{"role": "user", "content": parts}], blocks


def _assistant(content: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for j, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.{j}"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            use = _parse(ToolUseIn, block, at)
            arguments = json.dumps(use.input, ensure_ascii=False)
            calls.append(
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": arguments},
                }
            )
        elif kind not in SKIPPED_IN_HISTORY:
            raise _unsupported(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def chat_messages(req: CountTokensRequest) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The chat messages, and the block each of their image-bearing parts came from, by the
    part's place in the chat request (`messages.2.content.1` -> `messages.1.content.3`)."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        messages.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        if not message.content:
            # As Anthropic: "" and [] are no content, allowed only as the final assistant
            # message, a prefill of nothing: the answer starts as if it were not there.
            if i == last and message.role == "assistant":
                continue
            raise invalid(
                "all messages must have non-empty content except for the optional final "
                "assistant message",
                f"messages.{i}",
            )
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            turn, blocks = _user(message.content, f"messages.{i}.content")
            at = len(messages) + len(turn) - 1  # the user message, after any tool results
            names |= {f"messages.{at}.content.{j}": block for j, block in enumerate(blocks)}
            messages += turn
        else:
            messages += _assistant(message.content, f"messages.{i}.content")
    return messages, names


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, raw in enumerate(req.tools):
        if raw.get("type") not in (None, "custom"):
            raise invalid(
                f"server tools ({raw.get('type')!r}) are not supported: only client tools",
                f"tools.{i}.type",
            )
        tool: Tool = _parse(Tool, raw, f"tools.{i}")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(req: CountTokensRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return {}
    if choice.type == "tool":
        if not choice.name:
            raise invalid('tool_choice of type "tool" needs the tool\'s name', "tool_choice.name")
        chat_choice: Any = {"type": "function", "function": {"name": choice.name}}
    else:
        chat_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return {"tool_choice": chat_choice, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def _refuse_unsupported(req: CountTokensRequest) -> None:
    if req.thinking is not None and req.thinking.get("type") not in ("disabled", None):
        raise invalid(
            "extended thinking budgets are not supported: omit thinking, or use a model whose "
            "chat template reasons by itself",
            "thinking.type",
        )


# Chat fields whose errors are the Messages fields' errors, under their Anthropic names.
ANTHROPIC_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
}


def chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """The chat request `req` runs as (a count_tokens request: the prompt part alone), and the
    names of its content parts in `req` (`chat_messages`)."""
    _refuse_unsupported(req)
    messages, names = chat_messages(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": _tools(req),
        **_tool_choice(req),
    }
    if isinstance(req, MessagesRequest):
        body |= {
            "max_completion_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "stop": req.stop_sequences,
            "stream": req.stream,
            "user": req.metadata.user_id if req.metadata else None,
        }
        output_format = req.output_config.format if req.output_config else None
        if output_format is not None:  # structured outputs: the JSON the schema allows, enforced
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output_format.schema_},
            }
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        where = ".".join([ANTHROPIC_NAMES.get(loc[0], loc[0]), *loc[1:]]) if loc else None
        raise invalid(f"{where}: {first['msg']}" if where else first["msg"], where) from None
    return chat, names
