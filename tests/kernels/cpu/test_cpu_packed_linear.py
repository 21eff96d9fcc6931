"""Prepacked bfloat16 linear weights on the CPU (kernels/cpu/packed_linear.py) in oneDNN's layout
(what CPUs with AMX or without AVX512-BF16 get; forced here on every CPU): the same numbers as
F.linear, and the engine's tokens and logprobs with packed weights equal those with the weights
as loaded (--enforce-eager). The layout of our own is tests/kernels/cpu/test_cpu_bf16_linear.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.worker.cpu import pack_weights
from kernels.cpu import packed_linear
from kernels.cpu.packed_linear import can_pack, linear, pack
from tests.support.prompts import shared_prefix_prompts


@pytest.fixture(autouse=True)
def onednn_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "own_layout", lambda: False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (16, 96), (3, 5, 96), (300, 96)])
def test_packed_linear_equals_f_linear(bias: bool, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape) + shape[0])
    weight = torch.randn(200, 96, generator=gen).bfloat16()
    b = torch.randn(200, generator=gen).bfloat16() if bias else None
    x = torch.randn(*shape, generator=gen).bfloat16()
    assert can_pack(weight) and not can_pack(weight.float())
    got = linear(x, None, pack(weight), b)
    assert got.shape == (*shape[:-1], 200)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=0, rtol=0)


@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen2_dir", "qwen3_dir"])
def test_engine_tokens_equal_with_packed_weights(model_fixture: str, request) -> None:
    """Llama (tied embeddings), Qwen2 (q/k/v bias), Qwen3 (q/k norm), chunked and prefix-cached."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    from transformers import AutoTokenizer

    prompts = [
        p[:60]
        for p in shared_prefix_prompts(AutoTokenizer.from_pretrained(model_dir), prefix_len=40)
    ][:5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            enforce_eager=eager,
            max_num_batched_tokens=32,
            num_kv_blocks=64,
            max_model_len=128,
        )
        mlp = llm.engine.executor.runner.model.layers[0].mlp
        assert (mlp.gate_up_proj.packed is None) == eager
        assert (mlp.gate_up_proj.weight is None) != eager  # the unpacked copy is dropped
        results[eager] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for loaded, packed in zip(results[True], results[False]):
        assert packed.token_ids == loaded.token_ids
        assert packed.logprobs == loaded.logprobs


def test_float32_weights_stay_as_loaded(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64)
    model = llm.engine.executor.runner.model
    assert model.lm_head_packed is None and model.layers[0].mlp.down_proj.packed is None
    assert pack_weights(model) is False
