"""--quantize-activations int8 on the default model's Q4_1 file in bfloat16: its 4-bit linears
take int8 activations (the Q8_0 head stays exact), and its greedy tokens and logprobs stay within
stated bounds of the exact Q4_1 path on fixed prompts. Then what the flag refuses, each naming
it: no quantized weights, 8-bit ones, --batch-invariant, a GPU."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from config import ConfigError
from engine import LLM, SamplingParams
from engine.loading.model_spec import activation_quantization_unfit
from engine.models.base import DecoderModel
from engine.models.layers.linear import PackableLinear
from kernels.attention import Platform
from kernels.cpu.extension import KernelUnavailable

try:
    from kernels.cpu import quant_linear

    VNNI = quant_linear.VNNI
except KernelUnavailable:  # pragma: no cover - then the flag is refused at start-up
    VNNI = False

needs_vnni = pytest.mark.skipif(not VNNI, reason="this CPU lacks AVX512-VNNI/VBMI")

# The default tokenizer's ids of "The capital of France is", "def fibonacci(n):", "Water boils
# at a temperature of", "Once upon a time, there was a" (as tests/engine/loading/test_gguf.py).
PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [12615, 36411, 418, 253, 2779, 282],
    [6403, 1980, 253, 655, 28, 665, 436, 253],
]
# Measured on a Zen 4 (AVX512-VNNI, 2026-11-26), 16 greedy tokens a prompt against the exact
# Q4_1 path: the tokens agreed before the first difference 5 / 16 / 16 / 16 (the first prompt
# parts where the exact path's token had probability 0.39), the largest logprob difference over
# them 0.233. The bounds leave a little room for the order of the sums.
AGREED_EACH, AGREED_ALL, LOGPROB_BOUND = 4, 48, 0.35
# A difference only where the exact path was unsure: its token below this probability.
UNSURE = math.log(0.5)
Trace = list[list[tuple[int, float]]]


def _trace(llm: LLM) -> Trace:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    return [
        [(t, float(next(iter(lp.values())))) for t, lp in zip(s.token_ids, s.logprobs or [])]
        for s in (o.outputs[0] for o in llm.generate(PROMPTS, params))
    ]


@pytest.fixture(scope="module")
def traces() -> Iterator[tuple[Trace, Trace]]:
    got = []
    for activations in (None, "int8"):
        with LLM(
            None,
            dtype="bfloat16",
            quantization="gguf",
            quantize_activations=activations,
            num_kv_blocks=64,
            max_model_len=128,
        ) as llm:
            if activations is not None:
                model = llm.engine.executor.runner.model
                assert isinstance(model, DecoderModel)
                linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
                assert sum(m.int8_activations for m in linears) == 30 * 4
                assert not model.lm_head_int8_activations  # Q8_0: the exact path
            got.append(_trace(llm))
    yield got[0], got[1]


@needs_vnni
def test_greedy_tokens_and_logprobs_stay_near_the_exact_q4_1_path(
    traces: tuple[Trace, Trace],
) -> None:
    exact, int8 = traces
    worst_overall, agreed_all = 0.0, 0
    for want, got in zip(exact, int8):
        agreed = 0
        while agreed < len(want) and want[agreed][0] == got[agreed][0]:
            agreed += 1
        assert agreed >= AGREED_EACH, (want, got)
        if agreed < len(want):
            assert want[agreed][1] < UNSURE, (want, got)
        worst = max(abs(a[1] - b[1]) for a, b in zip(want[:agreed], got[:agreed]))
        assert worst <= LOGPROB_BOUND, (want, got)
        worst_overall, agreed_all = max(worst_overall, worst), agreed_all + agreed
    assert agreed_all >= AGREED_ALL
    assert worst_overall > 0  # the activations really were rounded


def test_without_quantized_weights_it_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--quantize-activations int8: it needs quantized"):
        LLM(str(llama_dir), quantize_activations="int8")


def test_with_8_bit_weights_it_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--quantize-activations int8: .* 8-bit"):
        LLM(str(llama_dir), quantization="int8", quantize_activations="int8")


def test_with_batch_invariance_it_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--quantize-activations.*--batch-invariant"):
        LLM(None, quantization="gguf", quantize_activations="int8", batch_invariant=True)


def test_an_unknown_value_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--quantize-activations"):
        LLM(None, quantization="gguf", quantize_activations="fp8")


def test_on_a_gpu_it_is_refused() -> None:
    gpu = Platform("cuda", torch.bfloat16, 64, (9, 0), lambda _: None)
    assert activation_quantization_unfit("gguf", gpu) == "it runs on the CPU, not a GPU"
    cpu = Platform("cpu", torch.bfloat16, 64, None, lambda _: None)
    why_not = activation_quantization_unfit("gguf", cpu)
    assert (why_not is None) == VNNI
