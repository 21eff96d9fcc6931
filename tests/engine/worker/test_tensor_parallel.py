"""Tensor parallelism on CPU (gloo, worker processes): greedy tokens with 2 and 4 ranks equal
those of one rank, float32, on random-weight Llama models with 1 and 4 KV heads and a Qwen3 with
2 (more ranks than KV heads replicates them) and vocabularies that do not divide evenly, under
chunked prefill, preemption and prefix caching, each run's workers stopping with its engine;
plus the pieces: shard arithmetic, a rank count that does not divide the model, the packed step
batch."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from engine import LLM, ModelLoadError, SamplingParams
from engine.distributed.shard import Shard
from engine.worker.model_input import HostBatch
from tests.support.models import build_random_model, folder_tokenizer
from tests.support.prompts import cut_prompts, shared_prefix_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
REGIMES = {
    "default": ({}, "varied"),
    # Chunked (24-token budget), preempted (56 blocks of 8) and prefix-cached at once.
    "all": (
        {"max_num_batched_tokens": 24, "num_kv_blocks": 56, "block_size": 8, "max_model_len": 384},
        "shared",
    ),
}


@pytest.fixture(scope="module")
def llama_kv4_dir(tmp_path_factory) -> Path:
    return build_random_model(
        tmp_path_factory.mktemp("llama_kv4"), "llama", "llama", shard=True, num_key_value_heads=4
    )


def run(
    model_dir: Path, regime: str, tensor_parallel_size: int
) -> tuple[list[list[int]], tuple[int, int]]:
    """Greedy tokens of the regime's prompts, and (preemptions, prefix-cache hits). The LLM
    runs one worker process per rank past the first, and closing it stops them (told to stop,
    not killed) and leaves the process group."""
    kwargs, prompt_set = REGIMES[regime]
    tokenizer = folder_tokenizer(model_dir)
    prompts = cut_prompts(tokenizer) if prompt_set == "varied" else shared_prefix_prompts(tokenizer)
    with LLM(
        str(model_dir), max_num_seqs=8, tensor_parallel_size=tensor_parallel_size, **kwargs
    ) as llm:
        workers = multiprocessing.active_children()
        assert len(workers) == tensor_parallel_size - 1
        outputs = llm.generate(prompts, GREEDY)
        kv, stats = llm.engine.kv, llm.last_run_stats
        assert kv.pool.num_free == kv.pool.num_blocks
        counters = (stats.num_preemptions, stats.prefix_cache_hits)
    assert all(not w.is_alive() and w.exitcode == 0 for w in workers)
    assert not torch.distributed.is_initialized()
    assert {o.outputs[0].finish_reason for o in outputs} == {"length"}
    return [o.outputs[0].token_ids for o in outputs], counters


_one_rank: dict[tuple[str, str], list[list[int]]] = {}

CASES = [
    ("llama_dir", 2, "default"),  # 1 KV head: replicated on both ranks
    ("llama_kv4_dir", 2, "all"),  # sharded checkpoint
    ("qwen3_dir", 2, "all"),  # 2 KV heads: one a rank
    # 4 ranks, 2 KV heads: each held by two ranks; a vocabulary that 4 does not divide.
    ("qwen3_dir", 4, "all"),
]


@pytest.mark.parametrize(("model_fixture", "size", "regime"), CASES)
def test_greedy_tokens_equal_one_rank(model_fixture: str, size: int, regime: str, request) -> None:
    model_dir: Path = request.getfixturevalue(model_fixture)
    key = (str(model_dir), regime)
    if key not in _one_rank:  # shared by the cases that differ only in their rank count
        _one_rank[key] = run(model_dir, regime, 1)[0]
    want = _one_rank[key]
    got, (preemptions, hits) = run(model_dir, regime, size)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (
            f"prompt {i}: first divergence at {next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)}"
        )
    if regime == "all":
        assert preemptions > 0 and hits > 0


def test_shard_arithmetic() -> None:
    assert [Shard(r, 4).split(8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [Shard(r, 2).split_padded(7) for r in range(2)] == [
        (0, 4),
        (4, 4),
    ]  # the last row is padding
    assert [Shard(r, 2).kv_heads(4) for r in range(2)] == [(0, 2), (2, 2)]
    # 4 ranks, 2 KV heads, 8 query heads: ranks 0-1 read KV head 0 (query heads 0-3), ranks 2-3 head 1.
    assert [Shard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [Shard(r, 4).split(8)[0] // (8 // 2) for r in range(4)] == [0, 0, 1, 1]


def test_a_rank_count_that_does_not_divide_the_model_fails_before_starting(qwen3_dir: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"--tensor-parallel-size 3 does not divide the 4 attention heads"
    ):
        LLM(str(qwen3_dir), tensor_parallel_size=3)
    assert multiprocessing.active_children() == []  # refused before any worker was started


def test_packed_step_batch_round_trips() -> None:
    tables = torch.tensor([[3, 4, 0], [7, 8, 9]], dtype=torch.int32)
    batch = HostBatch(
        [5, 6, 7, 8], [10, 11, 0, 1], [52, 53, 112, 113], [2, 2], [12, 2], tables, [1, 3], [(4, 6)]
    )
    back = HostBatch.unpack(batch.pack())
    assert back.block_tables.dtype == torch.int32 and torch.equal(back.block_tables, tables)
    back.block_tables = batch.block_tables
    assert back == batch
