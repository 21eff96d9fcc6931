"""OpenAI Responses API bodies (pydantic): the request, with OpenAI's parameter ranges, and the
response object with its output items, as openai-python's `Response` types shape them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from server.openai.protocol import INT64_MAX, INT64_MIN, Int, Text, _Request


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    # json_schema's fields sit beside `type` here, not under a json_schema key as in chat.
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextSettings(_Request):
    format: TextFormat | None = None


class ReasoningSettings(_Request):
    effort: str | None = None  # accepted: the model decides how long it reasons
    summary: str | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None  # function tools checked one by one, by type
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextSettings | None = None
    reasoning: ReasoningSettings | None = None
    # OpenAI's bounds: 16 pairs, keys of up to 64 characters, values of up to 512.
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(None, max_length=16)
    priority: Int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # vLLM's; see SamplingFields
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    # Declared so that they are refused by name (`inputs.py`), not ignored:
    # each would change the answer, and none is implemented.
    background: bool = False
    conversation: Any = None  # OpenAI's server-side conversation objects
    prompt: Any = None  # OpenAI's stored prompt templates
    top_logprobs: Int | None = Field(None, ge=0, le=20)

    def text_format(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------- responses

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning; it has no status, as in OpenAI's."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "in_progress"


OutputItem = Annotated[MessageItem | ReasoningItem | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # input tokens served from the prefix cache, not computed


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response object: the request's settings echoed as OpenAI echoes them (as the client
    sent them, extra keys and all), then the status, output and usage once it has run."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled", "auto"]
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]


class InputItemList(BaseModel):
    """`GET /v1/responses/{id}/input_items`: the request's input items as stored, one page."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# --------------------------------------------------------------------------- stream events
# Each event's `sequence_number` is its place in the stream, set as it is sent; it comes last,
# after the event's own fields, as OpenAI sends it.


class ResponseEvent(BaseModel):
    """What every stream event is: `type` names it and is its SSE event name."""

    type: str


class ResponseStateEvent(ResponseEvent):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject
    sequence_number: int = 0


class ErrorEvent(ResponseEvent):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
    sequence_number: int = 0


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int = 0


class OutputTextDelta(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)
    sequence_number: int = 0


class OutputTextDone(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)
    sequence_number: int = 0


class ReasoningTextDelta(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int = 0


class ReasoningTextDone(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int = 0


class FunctionCallArgumentsDelta(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str
    sequence_number: int = 0


class FunctionCallArgumentsDone(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str
    sequence_number: int = 0
