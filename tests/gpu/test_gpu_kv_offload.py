"""The KV offload tiers on a CUDA GPU (skipped without one; bench/gpu/gpu_check.sh runs these):
blocks copied out into pinned host tensors and back into other pool blocks with no
synchronization but the stream's order, their sources overwritten right after (a copy taken
late reads the new values), and an engine whose pool is too small giving the large pool's
greedy tokens from the host tier, the disk tier and the disk tier after a restart."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from engine import LLM, SamplingParams
from engine.kv_offload.block_io import PoolBlockIO

pytestmark = pytest.mark.gpu


def test_block_copies_are_pinned_and_stream_ordered() -> None:
    dev = torch.device("cuda")
    caches = [
        (
            torch.randn(8, 16, 2, 64, device=dev).bfloat16(),
            torch.randn(8, 16, 2, 64, device=dev).bfloat16(),
        )
        for _ in range(3)
    ]
    io = PoolBlockIO(lambda: caches)
    parts = [t for layer in caches for t in layer]
    for _ in range(20):
        want = [torch.stack([t[b] for t in parts]).view(io.block_shape()).cpu() for b in (3, 5)]
        stored = io.gather([3, 5])
        io.scatter([1, 2], stored.blocks)
        for t in parts:  # the sources change at once: the copies were taken before
            t[3].normal_()
            t[5].normal_()
        torch.cuda.synchronize()
        stored.wait()
        assert all(b.is_pinned() for b in stored.blocks)
        assert all(torch.equal(s, w) for s, w in zip(stored.blocks, want))
        got = [torch.stack([t[b] for t in parts]).view(io.block_shape()).cpu() for b in (1, 2)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_revisits_from_each_tier_give_the_large_pools_tokens(
    llama_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(0)
    docs = [[rng.randrange(1000, 20000) for _ in range(64)] for _ in range(6)]
    first = [d + [rng.randrange(1000, 20000) for _ in range(6)] for d in docs]
    second = [d + [rng.randrange(1000, 20000) for _ in range(6)] for d in docs]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = {
        "max_model_len": 128,
        "block_size": 16,
        "dtype": "float32",
        "device": "cuda",
        "enforce_eager": True,
        "max_num_seqs": 4,
    }
    with LLM(str(llama_dir), **common, num_kv_blocks=256) as big:
        want = [[o.outputs[0].token_ids for o in big.generate(p, params)] for p in (first, second)]
    disk = {"kv_offloading_disk_dir": str(tmp_path), "kv_offloading_disk_size": 0.01}
    for tier in ({"kv_offloading_size": 0.01}, disk):
        with LLM(str(llama_dir), **common, num_kv_blocks=12, **tier) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(first, params)] == want[0]
            again = llm.generate(second, params)
            assert [o.outputs[0].token_ids for o in again] == want[1]
            assert [o.num_cached_tokens for o in again] == [64] * 6
            assert llm.last_run_stats.external_prefix_cache_hits >= 4 * 64
    with LLM(str(llama_dir), **common, num_kv_blocks=12, **disk) as restarted:
        again = restarted.generate(second, params)
        assert [o.outputs[0].token_ids for o in again] == want[1]
        assert restarted.last_run_stats.external_prefix_cache_hits == 6 * 64
