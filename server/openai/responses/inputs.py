"""A Responses request as the chat request it runs as: input items become chat messages
(input_image parts chat image parts; function calls and their outputs assistant tool_calls and
tool messages), function tools and text.format their chat equivalents; anything the server
cannot honour is a 400."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import ValidationError

from server.errors import invalid
from server.openai.chat.protocol import ChatCompletionRequest
from server.openai.responses.protocol import FunctionTool, ResponsesRequest

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text", "output_text", "text"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("content must be a string or a list of text parts", where)
    return "\n".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise invalid(f"content part of type {kind!r} is not supported: only text", f"{where}.type")
    text: str = part["text"]
    return text


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An `input_image` part as the chat image part it runs as (its URL is loaded there)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise invalid(
            "input_image parts need an image_url (a data: or http(s) URL); file_id is not "
            "supported",
            f"{where}.image_url",
        )
    image_url = {"url": url}
    if part.get("detail") is not None:
        image_url["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image_url}


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or, where it holds images, its parts in order (one chat
    part per input part, so `where.j` names the same part in both)."""
    if not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    ):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(_image(part, f"{where}.{j}"))
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{where}.{j}")})
    return parts


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{item.get('type')} items need a string {name}", f"{where}.{name}")
    return value


def input_messages(
    items: str | list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(chat messages, the input items as stored: each with an id, and the input item each
    message came from: `input.3`)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    stored = []
    origins: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            given = item.get("role", "")
            role = ROLES.get(given) if isinstance(given, str) else None  # a list is no key
            if role is None:
                raise invalid(f"unknown role {item.get('role')!r}", f"{where}.role")
            content = item.get("content")
            messages.append(
                {"role": role, "content": _message_content(content, f"{where}.content")}
            )
            if isinstance(content, str):  # listed back as OpenAI lists it: as parts
                kind = "output_text" if role == "assistant" else "input_text"
                content = [{"type": kind, "text": content}]
            stored.append(
                {
                    "id": item.get("id") or item_id("msg"),
                    "type": "message",
                    "role": item["role"],
                    "content": content,
                    "status": "completed",
                }
            )
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            stored.append({"id": item.get("id") or item_id("fc"), **item})
        elif kind == "function_call_output":
            if not isinstance(item.get("output"), str | list):
                raise invalid("function_call_output items need an output", f"{where}.output")
            output = _text(item["output"], f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
            stored.append({"id": item.get("id") or item_id("fco"), **item})
        elif kind == "reasoning":
            stored.append({"id": item.get("id") or item_id("rs"), **item})  # the model's own, past
        else:
            raise invalid(f"input items of type {kind!r} are not supported", f"{where}.type")
        origins += [where] * (len(messages) - len(origins))  # the messages this item added
    return messages, stored, origins


def part_names(
    conversation: list[dict[str, Any]], origins: list[str | None], offset: int
) -> dict[str, str]:
    """Each content part of the chat request by the name of the input part it came from (the
    conversation's messages stand `offset` places in, after the instructions); a message of an
    earlier response has no origin here."""
    names = {}
    for k, (message, origin) in enumerate(zip(conversation, origins, strict=True)):
        if origin is not None and isinstance(message.get("content"), list):
            for j in range(len(message["content"])):
                names[f"messages.{k + offset}.content.{j}"] = f"{origin}.content.{j}"
    return names


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "function":
            raise invalid(
                f"built-in tools ({kind!r}) are not supported: only function tools",
                f"tools.{i}.type",
            )
        try:
            fn = FunctionTool.model_validate(tool)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise invalid(f"{first['msg']}", f"tools.{i}.{where}") from None
        definition = fn.model_dump(exclude={"type"}, exclude_none=True)
        tools.append({"type": "function", "function": definition})
    return tools


# `include` values that can be honoured: reasoning items are returned as plain text, so there is
# nothing to encrypt, and a client that asks for encrypted reasoning to send back gets that text.
INCLUDABLE = {"reasoning.encrypted_content"}


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise invalid("background responses are not supported", "background")
    if req.conversation is not None:
        raise invalid(
            "conversation objects are not supported: continue with previous_response_id",
            "conversation",
        )
    if req.prompt is not None:
        raise invalid("stored prompt templates are not supported", "prompt")
    if req.top_logprobs:
        raise invalid("logprobs are not supported on /v1/responses", "top_logprobs")
    for i, value in enumerate(req.include or []):
        if value not in INCLUDABLE:
            raise invalid(f"include value {value!r} is not supported", f"include.{i}")


def chat_request(
    req: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request this response runs as: instructions first (not carried into a
    continuation, as OpenAI does), then the conversation (the stored one, then this input)."""
    _refuse_unsupported(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system + conversation,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _tools(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
        "stream": req.stream,
        "priority": req.priority,
    }
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise invalid("text.format of type json_schema needs a schema", "text.format.schema")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "output",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise invalid(f"{where}: {first['msg']}", "input") from None
