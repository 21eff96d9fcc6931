"""The CPU paged-attention kernel (kernels/cpu, built on first use) against the torch reference:
GQA ratios 1/3/4/8 (decode rows through the two-pass decode path) and 16 (past that path's
instances: through the tile path, as float16 and odd head dims are), head dims 64/128 and odd ones, block sizes 16/32/128, ragged decode contexts,
chunks after a cached prefix, float32 and bfloat16; the same with sliding windows and softcaps
on every path (decode, tile, and SDPA chunks or, with a softcap, the kernel for them); then the
engine on it against the reference backend and transformers."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.attention.cpu_backend import KERNEL_MAX_QUERY_LEN, CpuPagedBackend
from kernels.attention.torch_ref import TorchReferenceBackend
from kernels.cpu.paged_attention_op import paged_attention
from tests.support.attention_cases import (
    DECODES,
    SHAPES,
    check_against_reference,
    naive_attention,
    random_step,
)
from tests.support.models import folder_tokenizer, hf_greedy
from tests.support.prompts import shared_prefix_prompts

# Contexts long enough for many 16-key chunks and several blocks of 128.
LONG = [(1000, 1), (700, 1), (3, 1), (520, 130), (129, 129)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    for shapes in (SHAPES, DECODES, LONG):
        check_against_reference(CpuPagedBackend, heads, kv_heads, dim, block_size, shapes)


@pytest.mark.parametrize("decodes", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_items_of_one_kv_head_and_of_all(decodes: int, dtype: torch.dtype) -> None:
    """Few decode rows are split one KV head per work item, to keep the threads busy; many take
    all of a request's KV heads per item. Both give the reference's output."""
    shapes = [(700 - 37 * i, 1) for i in range(decodes)]
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(CpuPagedBackend, 12, 4, 128, 16, shapes, dtype=dtype, atol=atol)


@pytest.mark.parametrize("dim", [8, 40, 96, 256])
def test_other_head_dims(dim: int) -> None:
    """Dims that are not 64 or 128 take the run-time path; ones not a multiple of 16 are padded."""
    check_against_reference(CpuPagedBackend, 8, 2, dim, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype: torch.dtype) -> None:
    check_against_reference(CpuPagedBackend, 12, 4, 64, 16, SHAPES + LONG, dtype=dtype, atol=2e-2)


def test_kernel_skips_the_chunks_left_to_sdpa() -> None:
    """Called alone, the kernel writes the rows of requests up to `max_query_len` rows (equal to
    the reference's) and leaves the longer chunks' rows as they were; with no limit it covers
    long chunks too."""
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    q, k, v, caches, meta = random_step(
        gen, rng, [(300, 1), (150, 70), (40, 17), (129, 129)], 16, 9, 3, 64
    )
    want = TorchReferenceBackend().forward(q, k, v, caches[0], caches[1], meta, 0.125)
    long_rows = torch.zeros(len(q), dtype=torch.bool)
    long_rows[1:71] = long_rows[88:] = True
    for limit in (32, 2**31 - 1):
        out = torch.full_like(q, float("nan"))
        paged_attention(
            out,
            q,
            caches[0],
            caches[1],
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seqlens_k,
            0.125,
            limit,
        )
        written = ~long_rows if limit == 32 else torch.ones_like(long_rows)
        assert out[~written].isnan().all()
        torch.testing.assert_close(out[written], want[written], atol=2e-5, rtol=1e-5)


# (sliding window, softcap): one key; less than a block with a cap that bites; several blocks,
# alone and with Gemma 2's cap; past every context; a cap alone.
WINDOW_SOFTCAP = [(1, None), (5, 2.0), (40, None), (40, 50.0), (2000, 2.0), (None, 2.0)]


@pytest.mark.parametrize(("window", "softcap"), WINDOW_SOFTCAP)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dtype"),
    [
        (9, 3, 64, torch.float32),
        (9, 3, 128, torch.bfloat16),
        (16, 1, 64, torch.bfloat16),
        (16, 1, 128, torch.float32),
    ],
    ids=["9-3-64-f32", "9-3-128-bf16", "16-1-64-bf16", "16-1-128-f32"],
)
def test_window_and_softcap_match_reference(
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
) -> None:
    """A group of 3 takes the decode path (4 does in test_sliding_window_softcap.py), 16 the
    tile path for decodes too; each dim and dtype with each. SHAPES has chunks after cached
    context past KERNEL_MAX_QUERY_LEN rows, LONG one more and a fresh one, which go to SDPA
    (with a window in its mask; bf16 where torch's micro-kernel runs: the prefill kernel) or, with a softcap,
    to the kernel."""
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(
        CpuPagedBackend,
        heads,
        kv_heads,
        dim,
        16,
        SHAPES + LONG,
        dtype=dtype,
        atol=atol,
        sliding_window=window,
        softcap=softcap,
    )


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (40, 2.0)])
def test_window_and_softcap_with_decode_items_of_one_kv_head(
    window: int, softcap: float | None
) -> None:
    """Decode rows fewer than two per thread (two, on two threads or more) are split one KV
    head per work item."""
    shapes = [(700, 1), (300, 1), (129, 129)]
    check_against_reference(
        CpuPagedBackend, 12, 4, 128, 16, shapes, sliding_window=window, softcap=softcap
    )


@pytest.mark.parametrize("block_size", [32, 128])
def test_window_over_larger_blocks(block_size: int) -> None:
    """The window's first key in the middle of a block, the blocks before it skipped."""
    for window, softcap in ((200, None), (77, 2.0)):
        check_against_reference(
            CpuPagedBackend, 9, 3, 64, block_size, LONG, sliding_window=window, softcap=softcap
        )


@pytest.mark.parametrize(("dim", "dtype"), [(40, torch.float32), (64, torch.float16)])
def test_window_and_softcap_on_the_run_time_paths(dim: int, dtype: torch.dtype) -> None:
    """A head dim read at run time, and float16 (whose decode rows take the tile path)."""
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for window, softcap in ((5, 2.0), (40, None)):
        check_against_reference(
            CpuPagedBackend,
            8,
            2,
            dim,
            16,
            SHAPES + LONG,
            dtype=dtype,
            atol=atol,
            sliding_window=window,
            softcap=softcap,
        )


@pytest.mark.parametrize(("window", "softcap"), [(40, None), (3, None), (40, 2.0)])
def test_kernel_alone_windows_long_chunks(window: int, softcap: float | None) -> None:
    """With no query length limit the kernel's tile path takes chunks of any length after
    cached context (which the backend sends it with a softcap, and SDPA without): the naive
    attention, the tiles past a window's first skipping the keys before it."""
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    shapes = [(520, 130), (129, 129), (300, 1), (90, KERNEL_MAX_QUERY_LEN + 1)]
    q, k, v, caches, meta = random_step(gen, rng, shapes, 16, 9, 3, 64)
    want = naive_attention(q, k, v, caches[0], caches[1], meta, 0.125, window, softcap)
    TorchReferenceBackend().forward(q, k, v, caches[0], caches[1], meta, 0.125)  # stores K/V
    out = torch.empty_like(q)
    paged_attention(
        out,
        q,
        caches[0],
        caches[1],
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seqlens_k,
        0.125,
        sliding_window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


# (shared prefix, token budget): chunks of at most 24 rows (all through the kernel); chunks of up
# to 64 rows, fresh or after a cached prefix (through SDPA).
@pytest.mark.parametrize(("prefix_len", "budget"), [(40, 24), (16, 64)])
@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen3_dir"])
def test_engine_greedy_tokens_equal_the_reference_backend_and_transformers(
    model_fixture: str, prefix_len: int, budget: int, request
) -> None:
    """Chunked, preempted (12 blocks of 16) and prefix-cached; the longest prompt first, so that
    its first chunk is a fresh one."""
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = folder_tokenizer(model_dir)
    prompts = [p[:70] for p in shared_prefix_prompts(tokenizer, prefix_len=prefix_len)][5::-1]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = {
        "max_num_batched_tokens": budget,
        "num_kv_blocks": 12,
        "block_size": 16,
        "max_model_len": 128,
        "max_num_seqs": 6,
        "dtype": "float32",
    }
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(model_dir), attention_backend=backend, **settings)
        assert llm.engine.spec.attention_backend == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.last_run_stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert outputs["cpu"] == outputs["torch"]
    assert outputs["cpu"] == hf_greedy(model_dir, prompts, 16)
