"""The bfloat16 linear of at most 16 rows (kernels/cpu/few_rows_linear.cpp) against a float32
reference and F.linear: every row count, output sizes that are not a multiple of its 32-column
blocks, with and without a bias; what it refuses; and that the engine packs a copy for it only
where it is preferred, and then runs decode steps on it with the tokens and logprobs of
`--enforce-eager`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.models.layers.linear import PackableLinear
from kernels.cpu import few_rows_linear
from tests.prompts import shared_prefix_prompts

pytestmark = pytest.mark.skipif(
    not few_rows_linear.AVAILABLE, reason="this CPU has no AVX512-BF16 (oneDNN takes every step)"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (200, 96), (17, 8), (576, 1536)])
def test_every_row_count_against_float32(bias: bool, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(out_features + in_features + bias)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = few_rows_linear.pack(weight)
    assert packed.shape == (-(-out_features // 32) * 2, in_features // 2, 16, 2)
    for rows in range(1, few_rows_linear.MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()
        got = few_rows_linear.linear(x, packed, b, out_features)
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
    full[:3] = few_rows_linear.linear(x, few_rows_linear.pack(weight), None, 17)
    assert bool((full[3] == 7.0).all())
    torch.testing.assert_close(full[:3], F.linear(x, weight), rtol=2**-7, atol=1e-2)


def test_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(64, 32).bfloat16()
    packed = few_rows_linear.pack(weight)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        few_rows_linear.linear(torch.randn(17, 32).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        few_rows_linear.linear(torch.randn(2, 30).bfloat16(), packed, None, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        few_rows_linear.linear(torch.randn(2, 32).bfloat16(), packed, None, 65)
    assert not few_rows_linear.can_pack(torch.randn(64, 31).bfloat16())  # odd input size
    assert not few_rows_linear.can_pack(weight.float())


def _packable(llm: LLM) -> list[PackableLinear]:
    model = llm.engine.executor.runner.model
    return [m for m in model.modules() if isinstance(m, PackableLinear)]


def test_no_copy_where_onednn_is_preferred(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(few_rows_linear, "PREFERRED", False)
    llm = LLM(str(llama_dir), dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    assert all(m.packed is not None and m.few_rows is None for m in _packable(llm))
    assert llm.engine.executor.runner.model.lm_head_few_rows is None


@pytest.mark.skipif(
    not few_rows_linear.PREFERRED,
    reason="this CPU has AMX: oneDNN's tile path takes every step (the kernel is not preferred)",
)
def test_engine_decodes_on_it_with_eager_tokens_and_logprobs(llama_dir: Path) -> None:
    """Llama (its head too), chunked and prefix-cached prefill on oneDNN,
    decode steps of at most 16 rows on the kernel, in the C++ layer loop and the Python layers."""
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
            assert all(m.few_rows is not None for m in _packable(llm))
            # the head: a linear of its own, or the embedding's copy where tied
            assert (model.lm_head_few_rows is not None) == model.tie_word_embeddings
            assert model.layer_stack is not None
        if mode == "python":
            model.layer_stack = None
        results[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for mode in ("stack", "python"):
        assert [o.token_ids for o in results[mode]] == [o.token_ids for o in results["eager"]]
        for got, want in zip(results[mode], results["eager"]):
            assert got.logprobs is not None and want.logprobs is not None
            for got_pos, want_pos in zip(got.logprobs, want.logprobs):
                assert got_pos.keys() == want_pos.keys()
                for token, logprob in got_pos.items():
                    assert logprob == pytest.approx(want_pos[token], abs=2e-2)
