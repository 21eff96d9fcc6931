"""Per-request sampling parameters, with vLLM's field names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputsParams

_INT64 = 2**63
# Below this a temperature samples as greedy (vLLM's threshold): dividing logits by a smaller
# one overflows them to infinities, whose softmax is NaN.
_GREEDY_BELOW = 1e-5
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    # Tokens generated before EOS, a stop token id or a stop string may end the output.
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives beside the chosen token
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # A JSON schema, regex, choice or grammar the output must follow.
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search (vLLM's v0 fields): n is the beam width; the n best hypotheses come back,
    # ranked by sum of logprobs / generated length ** length_penalty. `early_stopping` has
    # transformers' meaning: True, False (a heuristic) or "never".
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if (
            self.logit_bias is not None
        ):  # JSON gives string keys: make them token ids here, not mid-step
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    "logit_bias must map token ids to numbers", "logit_bias"
                ) from None
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        for name in _FLOAT_FIELDS:  # NaN passes no range check below, but inf passes some
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value}", name)
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (
                self.temperature >= 0,
                "temperature",
                f"temperature must be non-negative, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k >= 0,
                "top_k",
                f"top_k must be -1 (disabled) or at least 1, got {self.top_k}",
            ),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.seed is None or -_INT64 <= self.seed < _INT64,
                "seed",
                f"seed must fit in int64, got {self.seed}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (
                self.min_tokens >= 0
                and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                "min_tokens",
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens} "
                f"(max_tokens {self.max_tokens})",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                "logprobs",
                f"logprobs must be non-negative, got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0,
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (all(s for s in self.stop_strings), "stop", "stop strings must not be empty"),
            (
                all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()),
                "logit_bias",
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search ranks the model's raw log-probabilities: anything that would reshape or
        sample them, or that the beams cannot report, is refused rather than ignored."""
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}',
                "early_stopping",
            )
        if self.temperature != 0:
            raise InvalidRequestError(
                f"beam search is deterministic: temperature must be 0, got {self.temperature}",
                "temperature",
            )
        unsupported = [
            ("logprobs", self.logprobs is not None),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("stop", bool(self.stop_strings)),
            ("min_tokens", self.min_tokens > 0),
            ("logit_bias", bool(self.logit_bias)),
            ("structured_outputs", self.structured_outputs is not None),
            ("presence_penalty", self.presence_penalty != 0),
            ("frequency_penalty", self.frequency_penalty != 0),
            ("repetition_penalty", self.repetition_penalty != 1),
            ("top_p", self.top_p != 1),
            ("top_k", self.top_k != 0),
            ("min_p", self.min_p != 0),
        ]
        for param, used in unsupported:
            if used:
                raise InvalidRequestError(f"{param} is not supported with beam search", param)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
