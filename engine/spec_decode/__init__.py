"""Speculative decoding (--speculative-config): a proposer guesses each decoding sequence's
next tokens, and the step verifies them (speculator.py)."""

from __future__ import annotations

from config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.loading.model_spec import ModelSpec
from engine.spec_decode import draft_model
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle3 import Eagle3Proposer, eagle3_kv_bytes_per_block
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.speculator import Speculator
from engine.worker.executor import LocalExecutor, TensorParallelExecutor

__all__ = ["Speculator", "draft_kv_bytes_per_block", "make_speculator"]


def draft_kv_bytes_per_block(config: EngineConfig, target: ModelSpec) -> int:
    """What a draft model or an EAGLE-3 head adds to each KV block (0 for methods without
    one)."""
    spec = config.scheduler.speculative_config
    if spec is not None and spec.method == "eagle3":
        return eagle3_kv_bytes_per_block(config, target)
    if spec is None or spec.method != "draft_model":
        return 0
    return draft_model.draft_kv_bytes_per_block(config, target)


def make_speculator(
    config: EngineConfig,
    target: ModelSpec,
    kv: KVCacheManager,
    num_blocks: int,
    executor: LocalExecutor | TensorParallelExecutor,
) -> Speculator | None:
    """`executor`: the target's (an EAGLE-3 head reads its hidden states)."""
    spec = config.scheduler.speculative_config
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == "ngram":
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "eagle3":
        # The start-up's refusal of tensor parallelism came with the pool's sizing.
        assert isinstance(executor, LocalExecutor), "an EAGLE-3 head runs on one rank"
        eagle = Eagle3Proposer(config, target, executor, kv, num_blocks)
        return Speculator(spec, eagle, target.max_model_len, observer=eagle)
    else:
        proposer = DraftModelProposer(config, target, kv, num_blocks)
    return Speculator(spec, proposer, target.max_model_len)
