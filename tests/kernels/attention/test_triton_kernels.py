"""The Triton kernels (under Triton's interpreter on a CPU) against the torch reference, float32:
the KV store with padded slots and strided rows, and paged attention for decode rows with ragged
context lengths, prefill chunks, and chunks that follow a cached prefix, mixed in one step;
GQA ratios 1, 4 and 8, head dims 64 and 128 (and 256, 96, 8), block sizes 16 and 256; sliding
windows and softcaps. Then the whole engine on the Triton backend: the torch backend's greedy
tokens. On a CUDA machine the
same tests compile the kernels for it."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if (
    importlib.util.find_spec("triton") is None
):  # a dev dependency on Linux: CI must have it, elsewhere it may be missing
    if os.environ.get("CI"):
        raise RuntimeError("triton is not installed: pip install -e '.[dev]'")
    pytest.skip("triton is not installed", allow_module_level=True)


from engine import LLM, SamplingParams
from kernels.attention.triton_backend import TritonBackend
from kernels.kv_store import store_kv as torch_store_kv
from kernels.triton.store_kv import store_kv as triton_store_kv
from tests.support.attention_cases import check_against_reference
from tests.support.models import folder_tokenizer
from tests.support.prompts import shared_prefix_prompts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    got = [c.to(DEVICE) for c in caches]
    triton_store_kv(k.to(DEVICE), v.to(DEVICE), got[0], got[1], slots.to(DEVICE))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 256])
def test_paged_attention_matches_reference(
    heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    check_against_reference(TritonBackend, heads, kv_heads, dim, block_size, device=DEVICE)


@pytest.mark.parametrize("dim", [256, 96, 8])
def test_other_head_dims(dim: int) -> None:
    """256 (Gemma-sized), and sizes that are not powers of two or below a tile's side."""
    check_against_reference(TritonBackend, 8, 2, dim, 32, device=DEVICE)


@pytest.mark.parametrize(
    ("window", "softcap", "block_size"),
    [(1, None, 16), (5, 2.0, 16), (40, 50.0, 16), (None, 2.0, 16), (100, None, 256)],
)
def test_window_and_softcap_match_reference(
    window: int | None, softcap: float | None, block_size: int
) -> None:
    """A window of one key, one inside a tile of keys with a cap that bites, one across tiles
    (whose rows' windows start in different tiles), a cap alone, and a window starting in the
    middle of a block of 256."""
    check_against_reference(
        TritonBackend,
        8,
        2,
        64,
        block_size,
        device=DEVICE,
        sliding_window=window,
        softcap=softcap,
    )


# --------------------------------------------------------------------------- the engine on it


@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen3_dir"])
def test_engine_greedy_tokens_equal_with_the_triton_backend(model_fixture: str, request) -> None:
    """Chunked (a 24-token budget), preempted (12 blocks of 16) and prefix-cached, as the
    torch backend runs it: head dims 16 (Llama) and 32 (Qwen3)."""
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = folder_tokenizer(model_dir)
    # Four prompts of 5 blocks each already overflow the 12-block pool: preemption, chunks and
    # prefix hits as with more, each one a slow interpreted step fewer.
    prompts = [p[:70] for p in shared_prefix_prompts(tokenizer, prefix_len=40)][:4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = {
        "max_num_batched_tokens": 24,
        "num_kv_blocks": 12,
        "block_size": 16,
        "max_model_len": 128,
        "max_num_seqs": 6,
        # float32 on a GPU too, where --dtype auto would take bfloat16: near ties of a random
        # model then flip between two correct kernels.
        "dtype": "float32",
    }
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), attention_backend=backend, device=DEVICE, **settings)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.last_run_stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert outputs["triton"] == outputs["torch"]
