"""On a CUDA GPU (skipped without one; bench/gpu/gpu_check.sh runs it): every speculative method
gives the greedy tokens the engine gives without it, float32, Triton attention, a pool that
preempts and a budget that chunks; the target as its own draft has every guess accepted."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import LLM, SamplingParams
from tests.support.eagle3_heads import SHARP, VOCAB, head_tensors, write_head
from tests.support.models import build_random_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_random_model(
        tmp_path_factory.mktemp("target"),
        "llama",
        "llama",
        vocab_size=VOCAB,
        initializer_range=SHARP,
        num_hidden_layers=4,
    )


def generate(target: Path, speculative: dict[str, Any] | None) -> tuple[list[list[int]], Any]:
    g = torch.Generator().manual_seed(0)
    phrases = [torch.randint(100, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 11, 20)]
    prompts = [(p * 6)[: 10 + 9 * i] for i, p in enumerate(phrases)]
    llm = LLM(
        str(target),
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=48,
        num_kv_blocks=20,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        speculative_config=speculative,
    )
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    stats = llm.last_run_stats
    llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, stats


def test_every_method_gives_the_tokens_without_it(target_dir: Path, tmp_path: Path) -> None:
    plain, _ = generate(target_dir, None)
    head = write_head(tmp_path / "head", head_tensors(seed=5))
    methods: dict[str, dict[str, Any]] = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft_model": {"model": str(target_dir), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    }
    for name, config in methods.items():
        tokens, stats = generate(target_dir, config)
        assert tokens == plain, name
        assert stats.spec_decode.num_drafts > 0, name
        if name == "draft_model":  # the target as its own draft: every guess is its own token
            drafts = stats.spec_decode
            assert drafts.num_accepted_tokens == drafts.num_draft_tokens > 0
