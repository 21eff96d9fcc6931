"""The bodies of `POST /v1/chat/completions` (pydantic): the request with its tools, the
completion and its streamed chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from engine import InvalidRequestError
from server.openai.protocol import (
    ChatLogprobs,
    ChatMessage,
    Int,
    SamplingFields,
    Text,
    Usage,
    _Request,
)


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema when a grammar forces them


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        return (
            {"name": self.name, "arguments": self.arguments}
            if self.name
            else {"arguments": self.arguments}
        )


class ToolCallDelta(BaseModel):
    """A call's first chunk has its id, type and name; later ones only argument fragments."""

    index: int
    id: str | None = None
    function: ToolCallFunctionDelta

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": self.function}
        return {"index": self.index, "id": self.id, "type": "function", "function": self.function}


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        # A delta carries only what changed: {"role": ...} first, then {"content": ...}.
        fields = (
            ("role", self.role),
            ("content", self.content),
            ("reasoning_content", self.reasoning_content),
            ("tool_calls", self.tool_calls),
        )
        return {k: v for k, v in fields if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
