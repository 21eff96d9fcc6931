"""The bfloat16 linear of our own (kernels/cpu/bf16_linear.cpp) against a float32 reference and
F.linear: every row count of a decode step and prefill-sized ones across its row blocks, output
sizes that are not a multiple of its 32-column blocks, with and without a bias; what it
refuses; and that the engine packs its weights for it only where it is preferred, and then runs
prefill and decode steps on it with the tokens of `--enforce-eager` and logprobs within a bf16
rounding of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.layers.linear import PackableLinear
from kernels.cpu import bf16_linear, packed_linear
from tests.support.prompts import shared_prefix_prompts

pytestmark = pytest.mark.skipif(
    not bf16_linear.AVAILABLE, reason="this CPU has no AVX512-BF16 (oneDNN takes every step)"
)

# No rows, decode steps (1-16), one past the register tile's multiples, and prefill-sized
# steps, split into blocks of at most 256 rows: whole ones, and counts split evenly (258:
# 136 + 122, 600: 200 x 3, 2,049: 9 blocks of 232 and a last of 193).
ROW_COUNTS = [*range(18), 100, 256, 257, 258, 600, 2049]


def _own_layout(packed: torch.Tensor) -> bool:
    """Whether a packed weight is this kernel's (a plain tensor over 32-column padded blocks)
    rather than oneDNN's (an opaque mkldnn tensor)."""
    if packed.is_mkldnn:
        return False
    out_features, in_features = packed.shape
    return packed.untyped_storage().nbytes() == -(-out_features // 32) * 32 * in_features * 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (200, 96), (17, 8), (576, 1536)])
def test_every_row_count_against_float32(bias: bool, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(out_features + in_features + bias)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = bf16_linear.pack(weight)
    assert packed.shape == (out_features, in_features)  # the layer's shape, like oneDNN's
    assert _own_layout(packed)  # over 32-column blocks, padded
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        got = bf16_linear.linear(x, packed, b)
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        # float32 sums (exact products), one rounding to bf16: within half a bf16 unit of the
        # float32 result, plus the float32 sums' own error.
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4 * in_features**0.5)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=2**-7, atol=1e-2)


def test_padding_columns_are_not_written() -> None:
    """17 outputs: the last block holds one real column; the row after it stays untouched."""
    weight = torch.randn(17, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    full = torch.full((4, 17), 7.0, dtype=torch.bfloat16)
    full[:3] = bf16_linear.linear(x, bf16_linear.pack(weight), None)
    assert bool((full[3] == 7.0).all())
    torch.testing.assert_close(full[:3], F.linear(x, weight), rtol=2**-7, atol=1e-2)


def test_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(64, 32).bfloat16()
    packed = bf16_linear.pack(weight)
    with pytest.raises(RuntimeError, match="does not match"):
        bf16_linear.linear(torch.randn(2, 30).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="not packed by"):  # as loaded: no padded columns
        bf16_linear.linear(torch.randn(2, 32).bfloat16(), torch.randn(17, 32).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_linear.linear(torch.randn(2, 32).bfloat16(), packed, torch.zeros(63).bfloat16())
    assert not bf16_linear.can_pack(torch.randn(64, 31).bfloat16())  # odd input size
    assert not bf16_linear.can_pack(weight.float())


def _packable(llm: LLM) -> list[PackableLinear]:
    model = llm.engine.executor.runner.model
    return [m for m in model.modules() if isinstance(m, PackableLinear)]


def test_onednn_layout_where_it_is_preferred(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in for an AMX CPU: every weight goes to oneDNN, and the steps run on it."""
    monkeypatch.setattr(packed_linear, "own_layout", lambda: False)
    llm = LLM(str(llama_dir), dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    packed = [m.packed for m in _packable(llm)]
    assert packed and all(p is not None and p.is_mkldnn for p in packed)
    model = llm.engine.executor.runner.model
    # the head: among the linears above, or the embedding's copy where tied
    assert (model.lm_head_packed is not None) == model.tie_word_embeddings
    assert model.layers_runner is not None
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(
    not bf16_linear.PREFERRED,
    reason="this CPU has AMX: oneDNN's tile path takes every step (the kernel is not preferred)",
)
def test_engine_runs_on_it_with_eager_tokens_and_logprobs(llama_dir: Path) -> None:
    """Llama (its head too), chunked and prefix-cached prefill and decode steps on the
    kernel, in the C++ layer loop and the Python layers; one copy of each weight."""
    from transformers import AutoTokenizer

    prompts = [
        p[:60]
        for p in shared_prefix_prompts(AutoTokenizer.from_pretrained(llama_dir), prefix_len=40)
    ][:5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    settings = {"max_num_batched_tokens": 32, "num_kv_blocks": 64, "max_model_len": 128}
    results = {}
    for mode in ("eager", "stack", "python"):
        llm = LLM(str(llama_dir), dtype="bfloat16", enforce_eager=mode == "eager", **settings)
        model = llm.engine.executor.runner.model
        if mode != "eager":
            layers = _packable(llm)
            assert all(m.weight is None and m.packed is not None for m in layers)
            assert all(_own_layout(m.packed) for m in layers if m.packed is not None)
            # the head: among the linears above, or the embedding's copy where tied
            assert (model.lm_head_packed is not None) == model.tie_word_embeddings
            assert model.layers_runner is not None
        if mode == "python":
            model.layers_runner = None
        results[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for mode in ("stack", "python"):
        assert [o.token_ids for o in results[mode]] == [o.token_ids for o in results["eager"]]
        for got, want in zip(results[mode], results["eager"]):
            assert got.logprobs is not None and want.logprobs is not None
            for got_pos, want_pos in zip(got.logprobs, want.logprobs):
                assert got_pos.keys() == want_pos.keys()
                for token, logprob in got_pos.items():
                    assert logprob == pytest.approx(want_pos[token], abs=2e-2)
