"""Speculative decoding (--speculative-config): a proposer guesses each decoding sequence's
next tokens, and the step verifies them (speculator.py)."""

from __future__ import annotations

from config import ConfigError, EngineConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.speculator import Speculator

__all__ = ["Speculator", "make_speculator"]


def make_speculator(config: EngineConfig, max_model_len: int) -> Speculator | None:
    spec = config.scheduler.speculative_config
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        raise ConfigError(f"--speculative-config: method {spec.method!r} is not served here")
    return Speculator(spec, proposer, max_model_len)
