"""The fused CPU ops (kernels/cpu/fused_ops.cpp, built on first use) against the eager torch ops
they replace, and the engine with them against the engine without them (--enforce-eager) and
against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.models.layers.rotary import apply_rotary
from kernels.cpu import fused_ops
from tests.support.models import hf_greedy
from tests.support.prompts import shared_prefix_prompts

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What RMSNorm.forward computes without the fused op (and transformers' LlamaRMSNorm)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Equal where the fused op rounds at the same points from the same float32 values; within
    one rounding step of the dtype where float32 sums or exp differ in the last bit."""
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(
            got,
            want,
            atol=1e-5,
            rtol={torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[want.dtype],
        )


def sample(
    gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 40, 7])  # whole 16-lane vectors, a tail, a tail only
def test_rms_norm_and_add_rms_norm(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x, residual = sample(gen, 37, width, dtype=dtype), sample(gen, 37, width, dtype=dtype, scale=3)
    weight = sample(gen, width, dtype=dtype)
    # The float32 sum of squares is added in another order than torch's mean: the last bit of
    # the scale may differ, and with it a float32 result's; rounded to bf16/fp16 it rarely shows.
    assert_matches(
        fused_ops.rms_norm(x, weight, 1e-6), eager_rms_norm(x, weight, 1e-6), exact=False
    )
    normed, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, residual + x)  # the same rounding as torch's add
    assert_matches(normed, eager_rms_norm(residual + x, weight, 1e-6), exact=False)
    strided = torch.cat([x, x], dim=1)[:, :width]  # rows apart by 2 * width
    assert torch.equal(
        fused_ops.rms_norm(strided, weight, 1e-6), fused_ops.rms_norm(x, weight, 1e-6)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_mul(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = sample(gen, 19, 2 * width, dtype=dtype, scale=4)  # large enough to reach exp's tails
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(width, dim=-1)
    got = fused_ops.silu_mul(gate_up)
    assert got.shape == (19, width)
    assert_matches(got, F.silu(gate) * up, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 40])
def test_rotary_in_place_on_qkv_columns(dtype: torch.dtype, dim: int) -> None:
    """q and k as the column views of a fused qkv output (rows apart by the whole qkv width),
    rotated in place, bitwise as apply_rotary does it; v untouched."""
    gen = torch.Generator().manual_seed(dim)
    tokens, heads, kv_heads = 23, 9, 3
    qkv = sample(gen, tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    freqs = positions[:, None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = (torch.cat([f, f], dim=-1).to(dtype) for f in (freqs.cos(), freqs.sin()))
    before = qkv.clone()
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    want_q = apply_rotary(q, cos.unsqueeze(1), sin.unsqueeze(1))
    want_k = apply_rotary(k, cos.unsqueeze(1), sin.unsqueeze(1))
    fused_ops.rotary_(q, cos, sin)
    fused_ops.rotary_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], before[:, (heads + kv_heads) * dim :])


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        fused_ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        fused_ops.silu_mul(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="share a dtype"):
        fused_ops.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen3_dir"])
def test_engine_tokens_with_fused_ops_equal_eager_and_transformers(
    model_fixture: str, request
) -> None:
    """float32: greedy tokens equal the eager engine's and transformers'; bfloat16: tokens and
    logprobs equal the eager engine's. Chunked and prefix-cached."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    prompts = [
        p[:60]
        for p in shared_prefix_prompts(AutoTokenizer.from_pretrained(model_dir), prefix_len=40)
    ][:5]
    settings = {"max_num_batched_tokens": 64, "num_kv_blocks": 64, "max_model_len": 128}
    for dtype in ("float32", "bfloat16"):
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            logprobs=2 if dtype == "bfloat16" else None,
        )
        outputs = {}
        for eager in (True, False):
            llm = LLM(str(model_dir), dtype=dtype, enforce_eager=eager, **settings)
            assert (llm.engine.executor.runner.model.fused_ops is None) == eager
            outputs[eager] = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in outputs[False]] == [o.token_ids for o in outputs[True]]
        assert [o.logprobs for o in outputs[False]] == [o.logprobs for o in outputs[True]]
        if dtype == "float32":
            assert [o.token_ids for o in outputs[False]] == hf_greedy(model_dir, prompts, 12)
