"""What the OpenAI request and response bodies (pydantic) of every route share: the field types
with OpenAI's parameter ranges, the sampling fields, chat messages, usage, logprobs and models;
each API's own bodies are in its package's `protocol.py`.

Shapes follow the openai-python types; the extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `guided_*`, `structured_outputs`, ...) are vLLM's. Unknown
top-level fields are accepted and ignored, as vLLM does, except the ones whose silent loss would
change the answer (tools, suffix): those are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from engine import InvalidRequestError, RequestOutput
from engine.structured import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Beam search ranks a hypothesis by its logprob sum / length ** length_penalty, in float32 as
# transformers does. Within [-5, 5] that divisor stays a normal float32 for every length up to
# 2**25 tokens (5 * 25 < 126), so no score collapses to 0 or infinity and ties with the rest; the
# values used in practice (0.6 to 2: transformers' examples, summarisation models' defaults) are
# well inside. vLLM takes any float, which a large enough length overflows.
LENGTH_PENALTY_LIMIT = 5.0


def _whole(value: object) -> object:
    # 2.0 is the integer 2 to JSON Schema, and so to this server's own /openapi.json (and to
    # clients that write every number as a float); 1.5, NaN and Infinity stay refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field: strict (no "16", no true), except that a whole float is an integer.
Int = Annotated[int, BeforeValidator(_whole)]
# A token id: negative or huge values are caught here, the vocabulary bound by the engine.
# (The bounds come before the validator, or pydantic leaves them out of the JSON schema.)
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(_whole)]


def _encodable(text: str) -> str:
    # JSON's \ud800 escapes (and json's surrogatepass decoding of raw bytes) can deliver lone
    # surrogates, which no tokenizer takes and no UTF-8 response can carry.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"must be valid Unicode text, not a lone surrogate at position {exc.start}"
        ) from None
    return text


# Text the server tokenizes, renders or sends back.
Text = Annotated[str, AfterValidator(_encodable)]
MAX_STOP = 4  # OpenAI's limit on `stop`


def _few_stops(stops: list[str]) -> list[str]:
    # Said in words of the field, not as pydantic's "List should have at most 4 items after
    # validation", nor (in a union with a single string) as the string member's type error.
    if len(stops) > MAX_STOP:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} stop sequences, got {count}",
            {"limit": MAX_STOP, "count": len(stops)},
        )
    return stops


StopList = Annotated[
    list[Text], AfterValidator(_few_stops), Field(json_schema_extra={"maxItems": MAX_STOP})
]


class _Request(BaseModel):
    # JSON types as OpenAI checks them: no "16" for 16, no true for 1, no "yes" for true (strict;
    # see Int for whole floats), and no NaN or Infinity, which Python's json parser accepts.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: usage on every chunk as well, counted so far (only together with include_usage).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=128)
    stop: Text | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, le=INT64_MAX)  # past the vocabulary: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: Int | None = None
    ignore_eos: bool = False
    # vLLM's beam search: n is the beam width, the n best hypotheses are the choices.
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-LENGTH_PENALTY_LIMIT, le=LENGTH_PENALTY_LIMIT)
    early_stopping: bool | Literal["never"] = False
    # vLLM's: lower is served earlier, on a server started with --scheduling-policy priority.
    priority: Int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    min_tokens: Int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and their successor.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputsField | None = None

    def constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """The one structured output constraint the request gives, with the field that gave it."""
        given: list[tuple[StructuredOutputsParams, str]] = []

        def add(param: str, make: Callable[[], StructuredOutputsParams]) -> None:
            try:
                given.append((make(), param))
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param) from None

        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            add("response_format", lambda: StructuredOutputsParams(json_object=True))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            if schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format",
                )
            add("response_format", lambda: StructuredOutputsParams.json_schema(schema))
        if self.guided_json is not None:
            guided_json = self.guided_json
            add("guided_json", lambda: StructuredOutputsParams.json_schema(guided_json))
        if self.guided_regex is not None:
            add("guided_regex", lambda: StructuredOutputsParams(regex=self.guided_regex))
        if self.guided_choice is not None:
            choice = tuple(self.guided_choice)
            add("guided_choice", lambda: StructuredOutputsParams(choice=choice))
        if self.guided_grammar is not None:
            add("guided_grammar", lambda: StructuredOutputsParams(grammar=self.guided_grammar))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                so_json = so.json_
                add("structured_outputs", lambda: StructuredOutputsParams.json_schema(so_json))
            else:
                add(
                    "structured_outputs",
                    lambda: StructuredOutputsParams(
                        json_object=bool(so.json_object),
                        regex=so.regex,
                        choice=None if so.choice is None else tuple(so.choice),
                        grammar=so.grammar,
                    ),
                )
        if len(given) > 1:
            names = ", ".join(param for _, param in given)
            raise InvalidRequestError(
                f"give only one structured output constraint, not {names}", given[1][1]
            )
        return given[0] if given else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        # As vLLM reads it: without include_usage, continuous_usage_stats adds nothing.
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )

    def check(self) -> None:
        """Rules across fields, raised with the parameter to blame (pydantic would not name it)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.use_beam_search and self.stream:
            # The best hypotheses are known only when the search ends: nothing to stream.
            raise InvalidRequestError("stream is not supported with use_beam_search", "stream")
        if self.best_of is not None and self.best_of != self.n:
            # Every sample drawn is returned; none is ranked and dropped. Accepting another
            # value would silently give n answers where best-of-N selection was asked for.
            raise InvalidRequestError(
                f"best_of={self.best_of} is not supported: this server returns every sample it "
                f"draws, so best_of must equal n ({self.n}) or be left out",
                "best_of",
            )
        # Undeclared here (tools on completions, the old functions API, suffix), yet dropping
        # them would change the answer.
        for name in ("tools", "tool_choice", "functions", "suffix"):
            if (self.model_extra or {}).get(name):
                raise InvalidRequestError(f"{name} is not supported by this server", name)


class ImageURL(_Request):
    url: str  # data:, http(s):// or file:// (server/media checks and loads it)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ContentPart(_Request):
    """One part of a message's content: `text`, or `image_url` (for a model that reads
    images); other types are refused where the conversation is rendered."""

    type: str
    text: Text | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Request):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends and returns it


class MessageToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: which call it answers


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> Usage:
        """A prompt counts once however many samples it has, as OpenAI counts it; so do its
        cached tokens."""
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        total = prompt_tokens + completion_tokens
        cached = sum(out.num_cached_tokens for out in outputs)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str
    parent: str | None = None
    max_model_len: int
    # What it serves: generate (completions, chat) or embed (embeddings, score, rerank).
    task: Literal["generate", "embed"] = "generate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
