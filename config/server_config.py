"""HTTP server settings: where to listen, who may call, what the model is called."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from config.engine_config import EngineConfig, _Strict
from config.lora_names import lora_name_problem
from config.media_config import MediaSettings

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
# Whose names /metrics uses: ours (`pagedserve:*`), or vLLM's exact names and labels, so that
# dashboards, alerts and autoscaler rules written for a vLLM server work against this one.
MetricsNames = Literal["pagedserve", "vllm"]
# vLLM's names for the formats models write tool calls and reasoning in (server/openai/parsers/),
# and ours: `generic` (tools described in a system message, calls as constrained JSON) for a
# template with no tool format, `auto` to choose one from the chat template at start-up.
ToolCallParserName = Literal["auto", "generic", "hermes", "llama3_json", "mistral"]
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


class LoRAModule(_Strict):
    """One adapter named on the command line: vLLM's JSON form of --lora-modules."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None

    @field_validator("name")
    @classmethod
    def _name_allowed(cls, value: str) -> str:
        problem = lora_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """`name=path`, or a JSON object with name, path and, optionally, base_model_name."""
        try:
            if text.lstrip().startswith("{"):
                return cls.model_validate_json(text)
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
            return cls(name=name, path=path)
        except ValidationError as exc:
            raise ValueError(f"--lora-modules {text!r}: {exc.errors()[0]['msg']}") from None


class ServerConfig(MediaSettings):
    # The image-fetch settings are inherited: `media_policy()` gives what server/media reads.

    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    api_key: str | None = Field(
        None, repr=False, description="require 'Authorization: Bearer KEY' on /v1/*"
    )
    served_model_name: list[str] | None = Field(
        None,
        min_length=1,
        description="model names clients may ask for; the first is reported (default: MODEL)",
    )
    allowed_origins: list[str] = Field(["*"], description="CORS allowed origins")
    allowed_methods: list[str] = Field(["*"], description="CORS allowed methods")
    allowed_headers: list[str] = Field(["*"], description="CORS allowed headers")
    allow_credentials: bool = Field(False, description="CORS: allow credentials")
    uvicorn_log_level: LogLevel = Field("info", description="log level of the HTTP server")
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    engine_step_timeout: float = Field(
        300.0,
        gt=0,
        description="seconds one engine step may run before the engine counts as stuck: /health "
        "turns 503 and, after --shutdown-timeout more, the process exits 1 to be restarted",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=0,
        description="refuse new requests (503 + Retry-After) while this many admitted ones have no token "
        "yet (default: no limit)",
    )
    max_queue_time: float | None = Field(
        None,
        gt=0,
        description="seconds a request may wait for its first token before it is dropped with 503 "
        "(default: no limit)",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body accepted (413 beyond)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt accepted, in tokens (default: the context)"
    )
    max_output_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens one completion may ask for (default: what the context leaves)",
    )
    max_n: int = Field(128, ge=1, description="most completions one request may ask for (n)")
    max_prompts_per_request: int = Field(
        2048,
        ge=1,
        description="most completions one /v1/completions (or /v1/completions/render) request "
        "may ask for: its prompts times n (the default is the size of OpenAI's array limits, "
        "as for embedding inputs); a render answer may also take at most 4 times "
        "--max-body-bytes",
    )
    max_embedding_inputs: int = Field(
        2048,
        ge=1,
        description="most inputs one /v1/embeddings request may hold (OpenAI's limit: 2048), and "
        "most documents one score or rerank request may hold",
    )
    tool_call_parser: ToolCallParserName = Field(
        "auto",
        description="the format this model writes tool calls in, read for tool_choice 'auto' "
        "(hermes: Qwen/Hermes <tool_call>, llama3_json: Llama 3.x JSON, mistral: [TOOL_CALLS], "
        "generic: tools described in a system message and calls constrained to JSON, for "
        "templates with no tool format); auto: chosen from the chat template at start-up",
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="accepted for vLLM compatibility and does nothing: tool_choice 'auto' "
        "always works here",
    )
    reasoning_parser: ReasoningParserName | None = Field(
        None,
        description="split <think>...</think> into reasoning_content (qwen3: the model opens the "
        "block; deepseek_r1: the prompt opens it)",
    )
    metrics_names: MetricsNames = Field(
        "pagedserve",
        description="names at /metrics: 'pagedserve' (pagedserve:*), or 'vllm' for vLLM's own "
        'names and labels (vllm:*, engine="0") so that vLLM dashboards work unchanged',
    )
    responses_store: str = Field(
        "sqlite",
        min_length=1,
        description="where stored responses (/v1/responses with store: true) live: 'sqlite' (a "
        "file in the cache directory), 'sqlite:///path', 'redis://host:port/db' (shared by "
        "replicas; also rediss:// and unix:///path.sock), or 'none'",
    )
    responses_max_age_s: float = Field(
        30 * 24 * 3600.0,
        gt=0,
        description="seconds a stored response is kept before it is deleted (default: 30 days)",
    )
    lora_modules: list[str] | None = Field(
        None,
        description="LoRA adapters served from start-up (needs --enable-lora), each name=path or "
        'JSON {"name": ..., "path": ..., "base_model_name": ...}; a request selects one by '
        "its name in `model`",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM gates "
        "them behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable)",
    )
    responses_max_bytes: int = Field(
        1024**3,
        ge=1,
        description="most bytes of stored responses kept; the oldest are deleted first beyond it "
        "(default: 1 GiB)",
    )

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_parse(cls, value: list[str] | None) -> list[str] | None:
        modules = [LoRAModule.parse(text) for text in value or []]
        names = [m.name for m in modules]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"--lora-modules names {repeated} more than one adapter")
        return value

    def parsed_lora_modules(self) -> list[LoRAModule]:
        return [LoRAModule.parse(text) for text in self.lora_modules or []]


class ServeConfig(_Strict):
    """Everything `pagedserve serve` runs with."""

    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _kv_events_on_the_host(self) -> ServeConfig:
        # KV events with no endpoint named go where the HTTP API listens: a server kept on
        # loopback must not publish what its cache holds to every interface. Copies, so that
        # an engine config the caller holds is left as it was.
        events = self.engine.cache.kv_events_config
        if events is not None and events.endpoint is None:
            cache = self.engine.cache.model_copy(
                update={"kv_events_config": events.on_host(self.server.host)}
            )
            # Set past validate_assignment, which would run this validator once more.
            object.__setattr__(self, "engine", self.engine.model_copy(update={"cache": cache}))
        return self
