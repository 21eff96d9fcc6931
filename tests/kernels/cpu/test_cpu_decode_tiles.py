"""bfloat16 decode rows on AMX tiles (kernels/cpu/paged_attention.cpp, `decode_tiles`) against the
torch reference: GQA 1/3/4/8 with the columns of up to 16 query heads in one tile and more split
over several, head dims 64 and 128, blocks of 16/32/128 tokens, contexts ending inside and on
the edges of 16- and 32-key chunks, one KV head per work item and all of them, softcaps; the
layers the path leaves to the vector code (windows, blocks not a multiple of 16); and the
prefill kernel's products between decodes on the same threads (each sets its own tile shapes)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention.cpu_backend import CpuPagedBackend
from kernels.attention.torch_ref import TorchReferenceBackend
from kernels.cpu import paged_attention_op, prefill_attention_op
from kernels.cpu.paged_attention_op import paged_attention
from kernels.cpu.prefill_attention_op import prefill_attention
from tests.support.attention_cases import check_against_reference, naive_attention, random_step

pytestmark = pytest.mark.skipif(
    not paged_attention_op.DECODES_ON_TILES,
    reason="this CPU (or its OS) lends no AMX tiles: bfloat16 decodes take the vector path",
)

ATOL = 2e-2  # bf16 output (and bf16 probabilities) against a float32 computation

# Contexts at and around the 16-key tiles and 32-key value steps, one of many blocks.
EDGES = [(1, 1), (15, 1), (16, 1), (17, 1), (31, 1), (32, 1), (33, 1), (100, 1), (1000, 1)]


@pytest.mark.parametrize(
    ("heads", "kv_heads"),
    # 1 column a KV head; 3; 4; 8 (two KV heads a tile); 16 KV heads of 1 (a full tile); 24 (split)
    [(4, 4), (9, 3), (8, 2), (32, 4), (16, 16), (24, 24)],
)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_decodes_match_reference(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    check_against_reference(
        CpuPagedBackend, heads, kv_heads, dim, block_size, EDGES, dtype=torch.bfloat16, atol=ATOL
    )


@pytest.mark.parametrize("decodes", [1, 2, 9])
def test_items_of_one_kv_head_and_of_all(decodes: int) -> None:
    shapes = [(700 - 37 * i, 1) for i in range(decodes)]
    check_against_reference(CpuPagedBackend, 12, 4, 64, 16, shapes, dtype=torch.bfloat16, atol=ATOL)


@pytest.mark.parametrize("softcap", [50.0, 2.0])
def test_softcap(softcap: float) -> None:
    check_against_reference(
        CpuPagedBackend, 9, 3, 64, 32, EDGES, dtype=torch.bfloat16, atol=ATOL, softcap=softcap
    )


@pytest.mark.parametrize(("block_size", "window"), [(8, None), (16, 40), (32, 1)])
def test_layers_left_to_the_vector_path(block_size: int, window: int | None) -> None:
    check_against_reference(
        CpuPagedBackend,
        9,
        3,
        64,
        block_size,
        EDGES,
        dtype=torch.bfloat16,
        atol=ATOL,
        sliding_window=window,
    )


@pytest.mark.skipif(not prefill_attention_op.AVAILABLE, reason="no prefill kernel on this CPU")
def test_prefill_products_after_decodes_on_every_thread() -> None:
    """Both kernels leave the tiles configured their own way on every thread; each must set its
    shapes before multiplying (torch's brgemm, under the prefill kernel, skips setting a shape it
    believes still set, so both tell it to forget when they finish)."""
    gen, rng = torch.Generator().manual_seed(11), random.Random(11)
    shapes = [(400 - 11 * i, 1) for i in range(8)] + [(300, 300), (520, 130)]
    q, k, v, caches, meta = random_step(gen, rng, shapes, 16, 9, 3, 64)
    q, k, v, caches = (t.to(torch.bfloat16) for t in (q, k, v, caches))
    TorchReferenceBackend().forward(q, k, v, caches[0], caches[1], meta, 0.125)  # stores K/V
    want = naive_attention(q, k, v, caches[0], caches[1], meta, 0.125)
    out = torch.full_like(q, float("nan"))
    args = (caches[0], caches[1], meta.block_tables, meta.cu_seqlens_q, meta.seqlens_k, 0.125)
    for _ in range(3):  # prefill, decode, prefill, ...: each after the other on the same threads
        prefill_attention(out, q, *args, min_query_len=33)
        paged_attention(out, q, *args, max_query_len=1)
    prefill_attention(out, q, *args, min_query_len=33)
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL, rtol=1.6e-2)
