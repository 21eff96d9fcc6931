"""--quantization int8 on tiny random models in float32: every linear weight (the tied head too)
becomes int8 with a float32 scale per output row, and the engine's greedy tokens equal
transformers' on the de-quantized float32 weights, token for token. Then what the flag refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from config import ConfigError
from engine import LLM, SamplingParams
from engine.models.layers.linear import PackableLinear
from kernels.cpu.quant_layout import quantize
from tests.support.models import greedy_of

PROMPTS = [[1, 15, 27, 99, 4, 8], [3, 200, 17], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
MAX_TOKENS = 12


def _dequantized_greedy(folder: Path) -> list[list[int]]:
    """transformers' greedy tokens with every linear weight replaced by its int8 round trip
    (float32) and the embedding kept: what the engine serves under --quantization int8."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        if model.config.tie_word_embeddings:  # the head is quantized apart from the embedding
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.clone())
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(quantize(module.weight).dequantize())
    results = greedy_of(model, PROMPTS, MAX_TOKENS)
    assert not torch.equal(model.get_input_embeddings().weight, model.lm_head.weight)
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied; q/k/v bias and a tied head
def test_int8_greedy_equals_transformers_on_the_dequantized_weights(
    arch: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(f"{arch}_dir")
    want = _dequantized_greedy(folder)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(folder), dtype="float32", quantization="int8", num_kv_blocks=64) as llm:
        model = llm.engine.executor.runner.model
        linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
        # Every linear runs on int8 and keeps no float copy of its weight.
        assert linears and all(m.quantized is not None and m.weight is None for m in linears)
        assert (model.lm_head_quantized is not None) == (arch == "qwen2")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want


def test_an_unknown_quantization_is_refused_naming_the_flag(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--quantization"):
        LLM(str(llama_dir), quantization="awq")


def test_int8_is_not_batch_invariant(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--batch-invariant"):
        LLM(str(llama_dir), quantization="int8", batch_invariant=True)


def test_int8_needs_bfloat16_or_float32_activations(llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--quantization int8: .*float16"):
        LLM(str(llama_dir), quantization="int8", dtype="float16")
