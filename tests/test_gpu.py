"""On a CUDA GPU (skipped without one; bench/gpu_check.sh runs these): every attention backend
that can run there against the torch reference, greedy tokens against transformers, replayed
CUDA graphs against eager decode, and the KV pool sized from --gpu-memory-utilization."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from config import ConfigError
from engine import LLM, SamplingParams
from kernels.attention import Platform, build_backend, choose
from tests.attention_cases import DECODES, SHAPES, check_against_reference
from tests.models import hf_greedy
from tests.prompts import shared_prefix_prompts

pytestmark = pytest.mark.gpu

BACKEND_CASES = [  # (backend, dtype, block sizes)
    ("triton", torch.float32, (16, 256)),
    ("triton", torch.bfloat16, (16, 256)),
    ("flash-attn", torch.bfloat16, (256,)),
    ("flash-attn-4", torch.bfloat16, (128, 16)),
]


@pytest.mark.parametrize(("backend", "dtype", "block_sizes"), BACKEND_CASES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_backend_matches_reference(
    backend: str,
    dtype: torch.dtype,
    block_sizes: tuple[int, ...],
    heads: int,
    kv_heads: int,
    dim: int,
) -> None:
    try:
        choose(backend, Platform.detect("cuda", dtype, dim), block_sizes[0])
    except ConfigError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for block_size in block_sizes:
        for shapes in (SHAPES, DECODES):
            check_against_reference(
                lambda: build_backend(backend),
                heads,
                kv_heads,
                dim,
                block_size,
                shapes,
                device="cuda",
                dtype=dtype,
                atol=atol,
            )


def _prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return [
        p[:90] for p in shared_prefix_prompts(AutoTokenizer.from_pretrained(folder), prefix_len=40)
    ][:6]


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_greedy_tokens_equal_transformers(llama_dir: Path) -> None:
    """float32, the auto backend (triton: flash-attn takes half types only), CUDA graphs on,
    chunked prefill and prefix caching."""
    prompts = _prompts(llama_dir)
    want = hf_greedy(llama_dir, prompts, 24, device="cuda")
    _release()
    llm = LLM(
        str(llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64
    )
    assert llm.engine.executor.runner.graphs is not None
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert llm.last_run_stats.prefix_cache_hits > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_what_eager_decode_computes(llama_dir: Path, dtype: str) -> None:
    prompts = _prompts(llama_dir)
    params = [
        SamplingParams(temperature=0, max_tokens=10 + 5 * i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(llama_dir),
            device="cuda",
            dtype=dtype,
            enforce_eager=eager,
            num_kv_blocks=64,
            max_num_seqs=8,
        )
        runner = llm.engine.executor.runner
        assert (runner.graphs is None) == eager
        if not eager:
            assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]
        results[eager] = llm.generate(prompts, params)
        del llm, runner
        _release()
    tol = 1e-4 if dtype == "float32" else 5e-2
    for eager_out, graph_out in zip(results[True], results[False]):
        assert graph_out.outputs[0].token_ids == eager_out.outputs[0].token_ids
        got = [next(iter(p.values())) for p in graph_out.outputs[0].logprobs]
        want = [next(iter(p.values())) for p in eager_out.outputs[0].logprobs]
        assert got == pytest.approx(want, abs=tol)


def test_kv_pool_follows_gpu_memory_utilization(llama_dir: Path) -> None:
    total = torch.cuda.mem_get_info()[1]
    blocks = {}
    for share in (0.2, 0.4):
        _release()
        llm = LLM(str(llama_dir), device="cuda", gpu_memory_utilization=share)
        blocks[share] = llm.engine.kv.pool.num_blocks
        reserved = torch.cuda.memory_reserved()
        assert reserved <= share * total, (reserved, share * total)
        out = llm.generate(
            _prompts(llama_dir)[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
        del llm, out
    _release()
    # The second share adds 0.2 of the GPU, all of it to the pool (the weights and step are the same).
    per_block = (0.2 * total) / (blocks[0.4] - blocks[0.2])
    assert blocks[0.4] > blocks[0.2] > 0
    assert 0.9 < per_block / _bytes_per_block(llama_dir) < 1.1


def _bytes_per_block(folder: Path) -> int:
    from engine.model_loader import load_hf_config
    from engine.model_spec import kv_bytes_per_block
    from engine.models.registry import describe

    return kv_bytes_per_block(describe(load_hf_config(folder)), 16, torch.float32)
