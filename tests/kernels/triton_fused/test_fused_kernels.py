"""The fused Triton kernels of the GPU path (kernels/triton/fused_ops.py: RMSNorm with and
without the residual add, SiLU-mul, q/k norm + rotary + K/V store) against the torch ops the
layers run without them, under Triton's interpreter on a CPU (compiled on a CUDA machine).

float32: within 4 float32 ulps of the largest value compared (the kernels sum squares in another
order). bfloat16: within 4 bfloat16 ulps of it (2**-5 of it): the kernels round where torch
rounds, up to four times in a row (norm, weight, products with cos and sin, their sum), but the
interpreter of triton 3.9 truncates float32 to bfloat16 where a GPU rounds to nearest, each
rounding then up to one ulp off. Shapes: 1, 7 and 64 tokens; Qwen3-0.6B's (hidden 1024, 16 q heads, 8 kv heads, head
dim 128, q/k norms) and a Llama-style one without q/k norms; head dim 96 (Phi-3: half a head is
not a power of two). No model served here rotates part of a head (Phi-3 refuses
partial_rotary_factor < 1), so the kernel rotates whole heads."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if (
    importlib.util.find_spec("triton") is None
):  # as in tests/kernels/attention/test_triton_kernels.py
    if os.environ.get("CI"):
        raise RuntimeError("triton is not installed: pip install -e '.[dev]'")
    pytest.skip("triton is not installed", allow_module_level=True)

from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding, apply_rotary
from kernels.kv_store import store_kv
from kernels.triton.fused_ops import add_rms_norm, rms_norm, rope_store_kv, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the module docstring's tolerance for `want`'s dtype, scaled by its largest value."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulps = 2**-5 if want.dtype == torch.bfloat16 else 2**-21
    atol = ulps * max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=0, atol=atol)


def _norm(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(dim, generator=gen))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 1024), (7, 1024), (64, 96), (3, 576)])
def test_rms_norm_and_its_residual_add_match_the_torch_norm(
    dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    norm = _norm(hidden, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    weight = norm.weight.detach().to(DEVICE)
    assert_near(rms_norm(x.to(DEVICE), weight, EPS), norm(x).detach())
    normed, summed = add_rms_norm(x.to(DEVICE), residual.to(DEVICE), weight, EPS)
    want_normed, want_summed = norm.add_forward(x, residual)
    assert_near(summed, want_summed)
    assert_near(normed, want_normed.detach())


def test_rms_norm_reads_strided_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    norm = _norm(64, torch.float32, gen)
    wide = torch.randn(5, 3 * 64, generator=gen)
    x = wide[:, 64:128]  # a slice of wider rows, as of a fused projection's output
    assert_near(rms_norm(x.to(DEVICE), norm.weight.detach().to(DEVICE), EPS), norm(x).detach())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "width"), [(1, 3072), (7, 3072), (64, 96)])
def test_silu_mul_matches_the_gated_mlp(dtype: torch.dtype, tokens: int, width: int) -> None:
    gen = torch.Generator().manual_seed(tokens + width)
    gate_up = (3 * torch.randn(tokens, 2 * width, generator=gen)).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    assert_near(silu_mul(gate_up.to(DEVICE)), F.silu(gate) * up)


# (q heads, kv heads, head dim, q/k norms)
QWEN3_0_6B = (16, 8, 128, True)
LLAMA_STYLE = (4, 1, 64, False)  # GQA 4:1, no q/k norm
PHI3_HEAD = (2, 2, 96, True)  # half a head of 48: masked lanes
SMALL_QWEN = (2, 1, 32, True)
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "max_position_embeddings": 4096}


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None,
) -> torch.Tensor:
    """What the attention layer's torch path does: norms, rotary, then the backend's store."""
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    store_kv(k, v, caches[0], caches[1], slots)
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "shape"),
    [
        (1, QWEN3_0_6B),
        (7, QWEN3_0_6B),
        (7, LLAMA_STYLE),
        (3, PHI3_HEAD),
        (64, SMALL_QWEN),
    ],
)
def test_rope_store_kv_matches_norm_rotary_and_store(
    dtype: torch.dtype, tokens: int, shape: tuple[int, int, int, bool]
) -> None:
    heads, kv_heads, dim, qk_norm = shape
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    # q, k, v as slices of one fused projection row: strided token rows.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
    table = RotaryEmbedding(dim, 4096, QWEN3_ROPE, torch.device("cpu"), dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = table.lookup(positions)
    norms = (_norm(dim, dtype, gen), _norm(dim, dtype, gen)) if qk_norm else None
    # Slots in shuffled blocks of 16, spanning several blocks; every third token a pad (-1).
    num_blocks, block_size = 8, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2::3] = -1
    caches = tuple(
        torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
        for _ in range(2)
    )
    want_caches = (caches[0].clone(), caches[1].clone())
    with torch.no_grad():
        want_q = _reference(q, k, v, cos, sin, want_caches, slots, norms)
    got_caches = (caches[0].to(DEVICE), caches[1].to(DEVICE))
    weights = None if norms is None else (norms[0].weight.to(DEVICE), norms[1].weight.to(DEVICE))
    got_q = rope_store_kv(
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        cos[:, 0].to(DEVICE),
        sin[:, 0].to(DEVICE),
        got_caches[0],
        got_caches[1],
        slots.to(DEVICE),
        weights,
        EPS,
    )
    assert_near(got_q, want_q)
    assert_near(got_caches[0], want_caches[0])
    assert torch.equal(got_caches[1].cpu(), want_caches[1])  # v is copied, not computed
    # The pads' slots were not written: what is there is the cache's old content.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for got, old in zip(got_caches, caches):
        flat_got = got.cpu().view(num_blocks * block_size, -1)
        assert torch.equal(flat_got[untouched], old.view(num_blocks * block_size, -1)[untouched])
