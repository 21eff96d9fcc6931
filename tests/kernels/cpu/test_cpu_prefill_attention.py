"""The CPU prefill kernel for long bfloat16 chunks (kernels/cpu/prefill_attention.cpp) against
the naive attention and the torch reference: GQA 1/3/4/8/16, head dims 64/96/128/256, block sizes
16/32/128, fresh prompts and chunks after a cached prefix (contexts ending mid-tile and mid-block),
sliding windows; that it writes only the long chunks' rows; and that the CPU backend sends long
chunks to it, and the rest to the paged kernel, in one step."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention.backend import AttentionMetadata
from kernels.attention.cpu_backend import (
    KERNEL_MAX_QUERY_LEN,
    CpuPagedBackend,
    prefill_kernel_takes,
)
from kernels.attention.torch_ref import TorchReferenceBackend
from kernels.cpu import prefill_attention_op
from kernels.cpu.prefill_attention_op import prefill_attention
from tests.support.attention_cases import (
    SHAPES,
    check_against_reference,
    naive_attention,
    random_step,
)

pytestmark = pytest.mark.skipif(
    not prefill_attention_op.AVAILABLE,
    reason="torch's bfloat16 micro-kernel does not run on this CPU (the backend uses SDPA instead)",
)

# Long chunks only: fresh prompts of one tile, of several and a ragged one; chunks after cached
# context, one ending mid-block, one just past the paged kernel's limit.
LONG_CHUNKS = [(129, 129), (1000, 1000), (300, 33), (520, 130), (700, 333), (90, 33)]

# bf16 output against a float32 computation rounded once: a few units in the last place.
ATOL, RTOL = 2e-2, 1.6e-2


def _step(
    shapes: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    q, k, v, caches, meta = random_step(gen, rng, shapes, block_size, heads, kv_heads, dim)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), caches.bfloat16(), meta


def _run_kernel(
    shapes: list[tuple[int, int]],
    block_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The kernel's output on one step (NaN where it wrote nothing), the naive attention, and
    the step's row offsets."""
    q, k, v, caches, meta = _step(shapes, block_size, heads, kv_heads, dim, seed)
    want = naive_attention(q, k, v, caches[0], caches[1], meta, dim**-0.5, window)
    TorchReferenceBackend().forward(q, k, v, caches[0], caches[1], meta, dim**-0.5)  # stores K/V
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        out,
        q,
        caches[0],
        caches[1],
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seqlens_k,
        dim**-0.5,
        KERNEL_MAX_QUERY_LEN,
        window,
    )
    return out, want, meta.cu_seqlens_q.tolist()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_matches_naive_attention(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    out, want, _ = _run_kernel(LONG_CHUNKS, block_size, heads, kv_heads, dim)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dim", [96, 256])
def test_other_head_dims(dim: int) -> None:
    """A head dim that is not a multiple of the 32 an AMX tile multiplies at once, and the largest."""
    out, want, _ = _run_kernel(LONG_CHUNKS, 16, 8, 2, dim)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [1, 5, 40, 200, 5000])
@pytest.mark.parametrize("block_size", [16, 128])
def test_sliding_windows(window: int, block_size: int) -> None:
    """One key (the row itself), fewer than a block, a window a tile of keys does not hold, one
    past every context: tiles before a row's window skipped or masked, keys past it too."""
    out, want, _ = _run_kernel(LONG_CHUNKS, block_size, 12, 4, 64, window)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


def test_writes_only_the_long_chunks() -> None:
    """Rows of requests with at most `min_query_len` query rows (decodes, short chunks) are left
    as they were; every long chunk's row is written."""
    shapes = [(300, 1), (150, 70), (40, 17), (129, 129), (90, KERNEL_MAX_QUERY_LEN)]
    out, want, cu = _run_kernel(shapes, 16, 9, 3, 64, seed=3)
    for (_, q_len), start, end in zip(shapes, cu, cu[1:]):
        if q_len > KERNEL_MAX_QUERY_LEN:
            torch.testing.assert_close(out[start:end], want[start:end], atol=ATOL, rtol=RTOL)
        else:
            assert out[start:end].isnan().all()


def test_no_long_chunk_writes_nothing() -> None:
    out, _, _ = _run_kernel([(300, 1), (40, 17)], 16, 9, 3, 64)
    assert out.isnan().all()


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (16, 1)])
@pytest.mark.parametrize("window", [None, 40])
def test_backend_mixes_it_with_the_paged_kernel(
    heads: int, kv_heads: int, window: int | None
) -> None:
    """Through the CPU backend: decodes, short chunks and long ones in one bfloat16 step equal
    the torch reference, and the new K/V are stored alike."""
    assert prefill_kernel_takes(torch.bfloat16, 64, None)
    check_against_reference(
        CpuPagedBackend,
        heads,
        kv_heads,
        64,
        16,
        SHAPES + LONG_CHUNKS,
        dtype=torch.bfloat16,
        atol=ATOL,
        sliding_window=window,
    )


def test_what_it_takes() -> None:
    """bfloat16 without a softcap and a head dim in 16s; the rest goes to SDPA (or, with a
    softcap, to the paged kernel)."""
    assert prefill_kernel_takes(torch.bfloat16, 128, None)
    assert not prefill_kernel_takes(torch.float32, 128, None)
    assert not prefill_kernel_takes(torch.float16, 128, None)
    assert not prefill_kernel_takes(torch.bfloat16, 128, 50.0)
    assert not prefill_kernel_takes(torch.bfloat16, 40, None)


def test_rejects_other_dtypes() -> None:
    q, _, _, caches, meta = _step([(129, 129)], 16, 9, 3, 64, 0)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        prefill_attention(
            q.float(),
            q.float(),
            caches[0].float(),
            caches[1].float(),
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seqlens_k,
            0.125,
            KERNEL_MAX_QUERY_LEN,
        )
