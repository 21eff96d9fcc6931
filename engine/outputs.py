"""What the engine returns: vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A position's logprobs: token id -> logprob, the chosen token first, then the top alternatives.
PositionLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" (the engine failed this request) | None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    # Streaming: what is new since the previous output of this request.
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # Sum of the generated tokens' logprobs: set for beam search, whose ranking rests on it.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # prompt_logprobs[0] is None: the first prompt token has no context to be predicted from.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens the prefix cache served at the request's first admission (a recompute
    # after a preemption does not change it): what the client is billed as cached.
    num_cached_tokens: int = 0
    # Set when the engine failed this request (its completions end with "error"): why.
    error: str | None = None


@dataclass
class EmbeddingOutput:
    data: torch.Tensor  # [dimensions] float32 on the host

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """A pooling request's one and only output (vLLM's `outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None  # None: aborted before it ran
    finished: bool = True


# What one engine step hands back per request.
EngineOutput = RequestOutput | PoolingRequestOutput
