"""How the KV pool is sized: the settings' precedence, the profile step the GPU sizing runs (here
through the real model on the CPU), and the arithmetic from a memory reading to blocks. The
memory readings are given (`FixedProbe` stands in for a GPU's counters, which need CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config import ConfigError, EngineConfig
from engine import LLM
from engine.loading.model_spec import resolve_model_spec
from engine.worker.executor import LocalExecutor
from engine.worker.kv_sizing import (
    GIB,
    MemoryReading,
    fixed_pool_blocks,
    kv_budget_bytes,
    profile_batch,
    profiled_pool_blocks,
)


class FixedProbe:
    def __init__(self, reading: MemoryReading) -> None:
        self.reading, self.started = reading, 0

    def start(self) -> None:
        self.started += 1

    def read(self) -> MemoryReading:
        return self.reading


def test_settings_precedence() -> None:
    per_block, many = 2**20, 10**6
    both = EngineConfig.from_kwargs(num_kv_blocks=7, kv_cache_memory_gib=2)
    assert fixed_pool_blocks(both, per_block, True, many) == 7
    two_gib = EngineConfig.from_kwargs(kv_cache_memory_gib=2)
    assert fixed_pool_blocks(two_gib, per_block, True, many) == 2048
    assert fixed_pool_blocks(two_gib, per_block, False, 5) == 2048  # a budget given is kept
    unset = EngineConfig.from_kwargs()
    assert fixed_pool_blocks(unset, per_block, False, many) == 1024  # 1 GiB on a CPU
    # ... unless a full batch of full-length sequences fills less.
    assert fixed_pool_blocks(unset, per_block, False, 300) == 300
    assert fixed_pool_blocks(unset, per_block, True, many) is None  # profile the GPU
    tiny = EngineConfig.from_kwargs(kv_cache_memory_gib=0.001)
    assert fixed_pool_blocks(tiny, per_block, False, many) == 1


def test_a_small_models_cpu_pool_is_what_a_full_batch_holds(qwen3_dir: Path) -> None:
    """1 GiB would be ~100k blocks of this model's 2 layers: the pool stops at 4 sequences of
    256 tokens in blocks of 16."""
    with LLM(str(qwen3_dir), max_num_seqs=4, max_model_len=256, block_size=16) as llm:
        assert llm.engine.kv.pool.num_blocks == 4 * 16
        assert all(k.shape[0] == 4 * 16 for k, _ in llm.engine.executor.runner.kv_caches)


def test_budget_is_the_allowed_share_less_what_is_used_and_the_step_peak() -> None:
    reading = MemoryReading(total=80 * GIB, used=5 * GIB, step_peak=3 * GIB)
    assert kv_budget_bytes(reading, 0.9) == int(72 * GIB) - 8 * GIB
    assert kv_budget_bytes(reading, 0.05) < 0


@pytest.mark.parametrize(
    ("tokens", "seqs", "max_len", "block"),
    [(2048, 64, 4096, 16), (100, 256, 4096, 256), (8192, 4, 1024, 128), (7, 3, 64, 16)],
)
def test_profile_batch_is_the_heaviest_step(
    tokens: int, seqs: int, max_len: int, block: int
) -> None:
    batch = profile_batch(tokens, seqs, max_len, block)
    n = len(batch.query_lens)
    assert sum(batch.query_lens) == min(tokens, seqs * max_len) and n <= seqs
    assert max(batch.query_lens) <= max_len and batch.context_lens == batch.query_lens
    assert batch.slots == [-1] * sum(batch.query_lens)  # stores nothing
    assert int(batch.block_tables.abs().sum()) == 0 and batch.block_tables.shape[1] * block >= max(
        batch.query_lens
    )
    starts = [sum(batch.query_lens[:i]) for i in range(n)]
    assert batch.positions == [p for q in batch.query_lens for p in range(q)]
    assert batch.logits_indices == [s + q - 1 for s, q in zip(starts, batch.query_lens)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profiled_sizing_runs_the_step_on_the_scratch_cache(qwen3_dir: Path, backend: str) -> None:
    config = EngineConfig.from_kwargs(
        model=str(qwen3_dir),
        max_num_batched_tokens=300,
        max_num_seqs=8,
        block_size=16,
        attention_backend=backend,
        gpu_memory_utilization=0.5,
    )
    spec = resolve_model_spec(config)
    assert spec.max_model_len == 1024
    executor = LocalExecutor(config, spec)
    assert executor.runner.kv_caches[0][0].shape[0] == 1  # the one-block scratch cache
    before = [c.clone() for pair in executor.runner.kv_caches for c in pair]
    logits_rows: list[int] = []

    def run_step(batch):
        logits = executor.execute(batch)
        assert torch.isfinite(logits).all()
        logits_rows.append(logits.shape[0])
        return logits

    probe = FixedProbe(MemoryReading(total=10 * GIB, used=2 * GIB, step_peak=GIB))
    blocks = profiled_pool_blocks(config, 2**20, 1024, 16, run_step, probe)
    assert blocks == 2 * 1024  # (5 - 2 - 1) GiB of 1 MiB blocks
    assert probe.started == 1 and logits_rows == [8]
    after = [c for pair in executor.runner.kv_caches for c in pair]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # slots -1: nothing stored
    executor.allocate_kv(blocks)
    assert executor.runner.kv_caches[0][0].shape[0] == blocks


def test_no_room_left_is_a_config_error_naming_the_flags() -> None:
    config = EngineConfig.from_kwargs(block_size=16, max_num_batched_tokens=4096)
    probe = FixedProbe(MemoryReading(total=16 * GIB, used=14 * GIB, step_peak=GIB))
    with pytest.raises(ConfigError) as info:
        profiled_pool_blocks(config, 2**20, 1024, 16, lambda batch: None, probe)
    message = str(info.value)
    for words in (
        "14.00 GiB is in use",
        "4096-token step needs 1.00 GiB",
        "--gpu-memory-utilization 0.9",
        "--max-num-batched-tokens",
        "--num-kv-blocks",
    ):
        assert words in message
