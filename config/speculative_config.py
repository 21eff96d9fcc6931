"""`--speculative-config`: guess several tokens a step and verify them in one forward pass.

The flag and its JSON keys are vLLM's (`method`, `num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`, `model`, `draft_tensor_parallel_size`, `disable_by_batch_size`), so a value
written for a vLLM deployment works here when it names a method served here. An unknown key, a
value out of range or a method not served is a start-up error that names the key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from config.json_settings import parse_json_settings

# vLLM's methods that are not served here: named, so that the error says so rather than
# "not one of ...".
_NOT_SERVED = ("eagle", "medusa", "mlp_speculator", "mtp", "suffix")

# Speculation is off in a step with more running sequences than this, unless the config says
# otherwise. Measured on the CPU (bench/models/spec_decode.py --always, n-gram, k=4): on open-ended
# answers 1.0x at 16 running, 0.91x at 32, 0.73x at 64; on answers that copy their prompt still
# 1.38x at 16.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "eagle3"] | None = Field(
        None,
        description="'ngram': prompt lookup over the prompt and the output so far; "
        "'draft_model': a smaller model of the same tokenizer (default: draft_model when "
        "'model' is set); 'eagle3': an EAGLE-3 head reading the target's hidden states",
    )
    num_speculative_tokens: int = Field(
        ge=1, le=16, description="tokens guessed, then verified, per sequence and step"
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, le=64, description="ngram: shortest suffix looked up (default 2)"
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=64, description="ngram: longest suffix looked up (default 5)"
    )
    model: str | None = Field(
        None,
        min_length=1,
        description="draft_model: the draft's path or Hugging Face id; eagle3: the head's",
    )
    draft_tensor_parallel_size: int = Field(
        1, ge=1, le=1, description="the draft model runs on one rank"
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="no speculation in a step with more running sequences than this (default "
        f"{DEFAULT_DISABLE_BY_BATCH_SIZE}, measured on the CPU)",
    )

    @field_validator("method", mode="before")
    @classmethod
    def _served(cls, value: object) -> object:
        if value in _NOT_SERVED:
            raise ValueError(
                f"method {value!r} is not served here: use 'ngram', 'draft_model' or 'eagle3'"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        method = self.method or ("draft_model" if self.model is not None else None)
        if method is None:
            raise ValueError("'method' is required ('ngram', or 'draft_model' with 'model')")
        if method in ("draft_model", "eagle3") and self.model is None:
            raise ValueError(f"'method': {method!r} needs 'model', the draft's path or id")
        if method == "ngram" and self.model is not None:
            raise ValueError("'model' names a draft model: it is not used by 'method': 'ngram'")
        if method != "ngram" and (self.prompt_lookup_min or self.prompt_lookup_max):
            raise ValueError("'prompt_lookup_min' and 'prompt_lookup_max' are for 'ngram'")
        low = self.prompt_lookup_min or min(2, self.prompt_lookup_max or 2)
        high = self.prompt_lookup_max or max(5, low)
        if low > high:
            raise ValueError(
                f"'prompt_lookup_min' ({low}) must not exceed 'prompt_lookup_max' ({high})"
            )
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "prompt_lookup_min", low if method == "ngram" else None)
        object.__setattr__(self, "prompt_lookup_max", high if method == "ngram" else None)
        return self

    @property
    def max_batch_size(self) -> int:
        """The most running sequences a step may have and still speculate."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    return parse_json_settings(value, SpeculativeConfig)
