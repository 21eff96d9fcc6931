"""The bodies of Anthropic's Messages API (pydantic): the request, the message it returns and the
events of its stream, in the shapes of the `anthropic` SDK's types.

Content blocks arrive as plain objects and are checked one by one in `inputs.py`, so that a block
of a type this server cannot take (an image, a document) is refused by its own path
(`messages.0.content.1.type`), not by a union's list of everything it did not match."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from server.openai.protocol import INT64_MAX, Int, StopList, Text, _Request

Blocks = list[dict[str, Any]]


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: Text | Blocks


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, with type "tool"
    disable_parallel_tool_use: bool = False


class Metadata(_Request):
    user_id: Text | None = None


class Tool(_Request):
    """A client tool. Server tools (web search, code execution) carry a `type` of their own and
    are refused in `inputs.py`."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # read by nothing
    format: OutputFormat | None = None


class CountTokensRequest(_Request):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | Blocks | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int = Field(ge=1)  # required, as Anthropic requires it
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0, le=INT64_MAX)
    stop_sequences: StopList | None = None  # the chat route's limit, checked under this name
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


# --------------------------------------------------------------------------- the answer


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """The model's reasoning (with a reasoning parser). Unsigned: nothing here verifies it."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = TextBlock | ToolUseBlock | ThinkingBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


# --------------------------------------------------------------------------- stream events


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class BlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class BlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class BlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaBody(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDeltaBody
    usage: OutputUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = MessageStart | BlockStart | BlockDelta | BlockStop | MessageDelta | MessageStop
