"""The usage of a stream so far, for the chunks of a request with vLLM's
`stream_options.continuous_usage_stats`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import RequestOutput
from server.openai.protocol import PromptTokensDetails, Usage


@dataclass
class RunningUsage:
    """Counts as the final usage does (each prompt once, every sample's tokens), up to the
    chunks sent so far: a choice's tokens count from the chunk that carries its latest output."""

    prompt_tokens: int  # all the prompts', known before the first chunk
    num_prompts: int
    _tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    _cached: dict[int, int] = field(default_factory=dict)  # prompt index -> its cache hit

    def saw(self, prompt_index: int, output: RequestOutput) -> None:
        """An output of the prompt's request: the engine has admitted it, so its hit is known."""
        self._cached[prompt_index] = output.num_cached_tokens

    def sent(self, choice_index: int, num_tokens: int) -> Usage:
        """The usage to send with the chunk of choice `choice_index`, which has `num_tokens`
        tokens now."""
        self._tokens[choice_index] = num_tokens
        return self.now()

    def now(self) -> Usage:
        completion_tokens = sum(self._tokens.values())
        # A prompt not yet admitted has no hit to report yet: no details rather than a wrong 0.
        details = (
            PromptTokensDetails(cached_tokens=sum(self._cached.values()))
            if len(self._cached) == self.num_prompts
            else None
        )
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )
