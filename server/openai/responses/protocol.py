"""OpenAI Responses API request body (pydantic), with OpenAI's parameter ranges."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from server.openai.protocol import Int, Text, _Request


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
