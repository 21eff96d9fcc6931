"""The Triton kernels (under Triton's interpreter on a CPU) against the torch reference, float32:
the KV store with padded slots and strided rows, and paged attention for decode rows with ragged
context lengths, prefill chunks, and chunks that follow a cached prefix, mixed in one step;
GQA ratios 1, 4 and 8, head dims 64 and 128 (and 256, 96, 8), block sizes 16 and 256. Then how the backend is
chosen, and the whole engine on the Triton backend: the torch backend's greedy tokens."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernels.attention.selector import triton_installed

if not triton_installed():  # a dev dependency on Linux: CI must have it, elsewhere it may be missing
    if os.environ.get("CI"):
        raise RuntimeError("triton is not installed: pip install -e '.[dev]'")
    pytest.skip("triton is not installed", allow_module_level=True)

from transformers import AutoTokenizer  # noqa: E402

from config import ConfigError  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from kernels.attention import selector  # noqa: E402
from kernels.attention.backend import AttentionMetadata  # noqa: E402
from kernels.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from kernels.attention.triton_backend import TritonBackend  # noqa: E402
from kernels.kv_store import store_kv as torch_store_kv  # noqa: E402
from kernels.triton.store_kv import store_kv as triton_store_kv  # noqa: E402
from tests.prompts import shared_prefix_prompts  # noqa: E402


def test_store_kv_matches_torch_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim, blocks, block_size = 9, 2, 64, 6, 16
    fused = torch.randn(tokens, 3 * heads * dim, generator=gen)  # k and v as slices of one row
    k = fused[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    v = fused[:, 2 * heads * dim :].view(tokens, heads, dim)
    slots = torch.tensor([5, 17, -1, 40, 41, -1, 90, 3, 64])
    caches = [torch.randn(blocks, block_size, heads, dim, generator=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    torch_store_kv(k, v, want[0], want[1], slots)
    triton_store_kv(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def _step(gen: torch.Generator, rng: random.Random, shapes: list[tuple[int, int]], block_size: int, heads: int,
          kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step over requests of (context_len, query_len): the cache holds every request's
    earlier tokens in shuffled blocks; q, k, v are the step's new rows."""
    tables = []
    blocks_needed = [-(-ctx // block_size) for ctx, _ in shapes]
    order = list(range(1, sum(blocks_needed) + 1))  # block 0 stays unused: a table pad reads it
    rng.shuffle(order)
    it = iter(order)
    for n in blocks_needed:
        tables.append([next(it) for _ in range(n)])
    num_blocks = sum(blocks_needed) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    width = max(blocks_needed)
    table_tensor = torch.zeros(len(shapes), width, dtype=torch.int32)
    slots, cu = [], [0]
    for i, ((ctx, q_len), table) in enumerate(zip(shapes, tables)):
        table_tensor[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
        cu.append(cu[-1] + q_len)
    tokens = cu[-1]
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=table_tensor, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seqlens_k=torch.tensor([ctx for ctx, _ in shapes], dtype=torch.int32),
        query_lens=[q_len for _, q_len in shapes], context_lens=[ctx for ctx, _ in shapes],
    )
    return q, k, v, torch.stack([k_cache, v_cache]), meta


# (context length, query length): decodes with ragged contexts, a whole prompt, a first chunk,
# and chunks after a cached prefix (one ending mid-block, one spanning several tiles).
SHAPES = [(1, 1), (37, 1), (300, 1), (16, 1), (23, 23), (40, 17), (150, 70), (290, 33)]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_paged_attention_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    check_against_reference(heads, kv_heads, dim, block_size)


@pytest.mark.parametrize("dim", [256, 96, 8])
def test_other_head_dims(dim: int) -> None:
    """256 (Gemma-sized), and sizes that are not powers of two or below a tile's side."""
    check_against_reference(8, 2, dim, 32)


def check_against_reference(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    seed = hash((heads, kv_heads, dim, block_size)) % 2**31
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    shapes = rng.sample(SHAPES, len(SHAPES))  # decodes and chunks interleaved in the batch
    q, k, v, caches, meta = _step(gen, rng, shapes, block_size, heads, kv_heads, dim)
    scale = dim**-0.5
    want_caches, got_caches = caches.clone(), caches.clone()
    want = TorchReferenceBackend().forward(q, k, v, want_caches[0], want_caches[1], meta, scale)
    meta.backend_plan = None
    got = TritonBackend().forward(q, k, v, got_caches[0], got_caches[1], meta, scale)
    assert torch.equal(got_caches, want_caches)  # the new tokens were stored alike
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    ("requested", "device", "installed", "interpreted", "chosen"),
    [
        ("auto", "cuda", True, False, "triton"),
        ("auto", "cuda:1", False, False, "torch"),
        ("auto", "cpu", True, True, "torch"),  # the interpreter is for tests, never chosen by itself
        ("torch", "cuda", True, False, "torch"),
        ("triton", "cuda", True, False, "triton"),
        ("triton", "cpu", True, True, "triton"),
    ],
)
def test_backend_selection(monkeypatch: pytest.MonkeyPatch, requested: str, device: str, installed: bool,
                           interpreted: bool, chosen: str) -> None:
    monkeypatch.setattr(selector, "triton_installed", lambda: installed)
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    name, why = selector.choose(requested, device)
    assert name == chosen and why


@pytest.mark.parametrize(
    ("requested", "device", "installed", "words"),
    [
        ("triton", "cpu", True, "needs a CUDA device"),
        ("triton", "cuda", False, "triton is not installed"),
        ("flash", "cuda", True, "must be one of auto, torch, triton"),
    ],
)
def test_unavailable_backend_is_a_config_error(monkeypatch: pytest.MonkeyPatch, requested: str, device: str,
                                               installed: bool, words: str) -> None:
    monkeypatch.setattr(selector, "triton_installed", lambda: installed)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=words) as info:
        selector.choose(requested, device)
    assert "--attention-backend" in str(info.value)


# --------------------------------------------------------------------------- the engine on it


@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen3_dir"])
def test_engine_greedy_tokens_equal_with_the_triton_backend(model_fixture: str, request) -> None:
    """Chunked (a 24-token budget), preempted (12 blocks of 16) and prefix-cached, as the
    torch backend runs it: head dims 16 (Llama) and 32 (Qwen3)."""
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [p[:70] for p in shared_prefix_prompts(tokenizer, prefix_len=40)][:6]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = {"max_num_batched_tokens": 24, "num_kv_blocks": 12, "block_size": 16, "max_model_len": 128, "max_num_seqs": 6}
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), attention_backend=backend, **settings)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert outputs["triton"] == outputs["torch"]
