"""Greedy tokens equal transformers' `generate`, token for token, under every scheduling regime:
plain batching, prompts chunked over many steps, a pool so small that requests are preempted and
recomputed, and prefix caching with shared prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.models import folder_tokenizer, hf_greedy_batched
from tests.support.prompts import cut_prompts, shared_prefix_prompts

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

# name -> (LLM kwargs, prompt set)
REGIMES = {
    "default": ({}, "varied"),
    "chunked": ({"max_num_batched_tokens": 16}, "varied"),
    "preempt": ({"num_kv_blocks": 32, "block_size": 16, "max_model_len": 384}, "varied"),
    "prefix_cache": ({"enable_prefix_caching": True}, "shared"),
    # Everything at once, with small blocks: chunked, preempted and prefix-cached.
    "all": (
        {"max_num_batched_tokens": 24, "num_kv_blocks": 56, "block_size": 8, "max_model_len": 384},
        "shared",
    ),
}
RANDOM_MODELS = ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir"]
# The default model (the random Llama's architecture, real weights) in plain batching and in the
# regime that chunks, preempts and prefix-caches at once: each of its steps costs what a random
# model's whole run does.
CASES = [(model, regime) for model in RANDOM_MODELS for regime in REGIMES] + [
    ("default_model_dir", "default"),
    ("default_model_dir", "all"),
]

_oracle: dict[tuple[str, str], tuple[list[list[int]], list[list[int]]]] = {}


def oracle(model_dir: Path, prompt_set: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and transformers' greedy continuations, computed once per model and prompt set."""
    key = (str(model_dir), prompt_set)
    if key not in _oracle:
        tokenizer = folder_tokenizer(model_dir)
        prompts = (
            cut_prompts(tokenizer) if prompt_set == "varied" else shared_prefix_prompts(tokenizer)
        )
        _oracle[key] = (prompts, hf_greedy_batched(model_dir, prompts, MAX_NEW))
    return _oracle[key]


@pytest.mark.parametrize(("model_fixture", "regime"), CASES)
def test_greedy_tokens_equal_transformers(model_fixture: str, regime: str, request) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    kwargs, prompt_set = REGIMES[regime]
    prompts, expected = oracle(model_dir, prompt_set)

    llm = LLM(str(model_dir), max_num_seqs=8, **kwargs)
    outputs = llm.generate(prompts, GREEDY)

    got = [o.outputs[0].token_ids for o in outputs]
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"prompt {i} ({len(prompts[i])} tokens): first divergence at {next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)}"
        )
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)

    stats, kv = llm.last_run_stats, llm.engine.kv
    if regime == "chunked":
        assert max(len(p) for p in prompts) > 16  # so some prompt really was chunked
    if regime in ("preempt", "all"):
        assert stats.num_preemptions > 0, (
            "the pool was meant to be too small: no preemption happened"
        )
    if regime in ("prefix_cache", "all"):
        assert stats.prefix_cache_hits > 0, "shared prefixes produced no cache hit"
    # Whatever happened, every block is back in the pool.
    assert kv.pool.num_free == kv.pool.num_blocks
    kv.check_consistency()
