"""The C++ loop over a Llama-shaped model's layers (engine/worker/cpu/layer_stack.py) against the
Python layers it replaces, which run the same fused ops and attention backend: the same logits,
logprobs and KV cache, bit for bit, in float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cpu.layer_stack import stack_cpu_layers
from engine.worker.model_input import HostBatch
from tests.support.models import build_random_model, folder_tokenizer
from tests.support.prompts import shared_prefix_prompts

# Small steps (chunks after cached context), a prefix cache to hit, long enough for decode.
SETTINGS = {
    "max_num_batched_tokens": 48,
    "num_kv_blocks": 64,
    "max_model_len": 160,
    "block_size": 16,
}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    """Phi-3: a Llama-shaped model with a sliding window (27) on every layer."""
    return build_random_model(tmp_path_factory.mktemp("phi3"), "phi3", "llama")


def engines(model_dir: Path, dtype: str) -> tuple[LLM, LLM]:
    """Two engines on one model: the first runs the C++ loop, the second its Python layers."""
    stacked, python = (LLM(str(model_dir), dtype=dtype, **SETTINGS) for _ in range(2))
    assert stacked.engine.executor.runner.model.layers_runner is not None
    python.engine.executor.runner.model.layers_runner = None
    return stacked, python


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_fixture", ["llama_dir", "qwen2_dir", "qwen3_dir", "phi3_dir"])
def test_generation_equals_python_layers(model_fixture: str, dtype: str, request) -> None:
    """GQA, q/k/v bias, q/k norms and a sliding window the prompts outgrow; prompts that share
    a prefix (cached blocks), chunked prefill through the paged kernel and SDPA (bf16 where torch's
    micro-kernel runs: the prefill kernel), then decode."""
    model_dir: Path = request.getfixturevalue(model_fixture)
    tokenizer = folder_tokenizer(model_dir)
    prompts = [p[:70] for p in shared_prefix_prompts(tokenizer, prefix_len=40)][:4]
    prompts.append(prompts[0][:5])  # short enough for the kernel's prefill path
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    stacked, python = engines(model_dir, dtype)
    got = [o.outputs[0] for o in stacked.generate(prompts, params)]
    want = [o.outputs[0] for o in python.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert stacked.last_run_stats.prefix_cache_hits > 0


def test_padding_rows_store_nothing(llama_dir: Path) -> None:
    """Rows whose slot is -1 are computed but not stored; the other rows' K/V land where the
    Python layers put them, and every row's logits are theirs."""
    stacked, python = engines(llama_dir, "bfloat16")
    batch = HostBatch(
        input_ids=list(range(100, 140)) + list(range(200, 205)),
        positions=list(range(40)) + list(range(5)),
        slots=list(range(40, 77)) + [-1, -1, -1] + list(range(5)),
        query_lens=[40, 5],
        context_lens=[40, 5],
        block_tables=torch.tensor([[2, 3, 4], [0, 0, 0]], dtype=torch.int32),
        logits_indices=list(range(45)),
        block_copies=[],
    )
    got, want = (llm.engine.executor.runner for llm in (stacked, python))
    assert torch.equal(got.execute(batch), want.execute(batch))
    for (k_got, v_got), (k_want, v_want) in zip(got.kv_caches, want.kv_caches):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    k_rows = got.kv_caches[0][0].flatten(0, 1).flatten(1)  # [slots, heads * dim]
    stored = k_rows.abs().sum(-1).nonzero().flatten().tolist()
    assert stored == list(range(5)) + list(range(40, 77))


def test_models_it_does_not_cover_keep_their_layers(tmp_path: Path) -> None:
    gemma = build_random_model(tmp_path / "gemma2", "gemma2", "llama")
    llm = LLM(str(gemma), dtype="float32", **SETTINGS)
    model = llm.engine.executor.runner.model
    assert model.layers_runner is None
    assert stack_cpu_layers(model) == "SandwichLayer layers"
    eager = LLM(str(gemma), dtype="float32", enforce_eager=True, **SETTINGS)
    assert eager.engine.executor.runner.model.layers_runner is None
