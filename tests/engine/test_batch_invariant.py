"""--batch-invariant on the default model in bfloat16: a request's tokens and logprobs do not
depend on the batch it ran in. Without the flag they do (the control below): long prompts are cut
into chunks where the step's budget runs out, and the prefill kernel, the paged kernel's tile path
and its decode path each sum in their own order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from config import ConfigError
from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from kernels.cpu.packed_linear import fixed_order_available
from tests.support.prompts import cut_prompts

pytestmark = pytest.mark.skipif(
    not fixed_order_available(), reason="the fixed-order linear kernel needs AVX512-BF16"
)

# Long prompts of unequal lengths and a small step budget, so that batched prompts are cut at
# other points than a prompt alone, and short chunks go to other kernels than long ones.
LENGTHS = [40 + 50 * i for i in range(8)]
SETTINGS = {"dtype": "bfloat16", "max_num_batched_tokens": 64, "num_kv_blocks": 512}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

Trace = list[tuple[int, float]]


def _trace(output: RequestOutput) -> Trace:
    """Each token with its logprob, bit for bit."""
    sample = output.outputs[0]
    assert sample.logprobs is not None
    return [(t, float(next(iter(lp.values())))) for t, lp in zip(sample.token_ids, sample.logprobs)]


def _batched_and_alone(llm: LLM, prompts: list[list[int]]) -> tuple[list[Trace], list[Trace]]:
    batched = [_trace(o) for o in llm.generate(prompts, PARAMS)]
    alone = [_trace(llm.generate(p, PARAMS)[0]) for p in prompts]
    return batched, alone


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    return cut_prompts(AutoTokenizer.from_pretrained(default_model_dir), LENGTHS)


@pytest.fixture
def llm(request: pytest.FixtureRequest, default_model_dir: Path) -> Iterator[LLM]:
    with LLM(str(default_model_dir), batch_invariant=request.param, **SETTINGS) as llm:
        yield llm


@pytest.mark.parametrize("llm", [False], indirect=True)
def test_without_the_flag_the_batch_changes_the_numbers(llm: LLM, prompts) -> None:
    batched, alone = _batched_and_alone(llm, prompts)
    assert batched != alone  # else this workload proves nothing about the flag


@pytest.mark.parametrize("llm", [True], indirect=True)
def test_with_the_flag_a_request_alone_equals_it_batched(llm: LLM, prompts) -> None:
    batched, alone = _batched_and_alone(llm, prompts)
    assert batched == alone
    # Prefix-cache hits change a prompt's chunks too: the same prompts again, all cached.
    assert [_trace(o) for o in llm.generate(prompts, PARAMS)] == alone
    assert llm.last_run_stats.prefix_cache_hits > 0


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"dtype": "float32"}, "bfloat16"),
        ({"dtype": "bfloat16", "attention_backend": "torch"}, "cpu attention backend"),
        ({"dtype": "bfloat16", "enforce_eager": True}, "--enforce-eager"),
    ],
)
def test_refused_where_it_cannot_hold(default_model_dir: Path, settings, named: str) -> None:
    with pytest.raises(ConfigError, match="--batch-invariant") as info:
        LLM(str(default_model_dir), batch_invariant=True, **settings)
    assert named in str(info.value)


def test_refused_for_a_mixture_of_experts(tmp_path: Path) -> None:
    from tests.support.models import build_random_model

    folder = build_random_model(tmp_path / "mixtral", "mixtral", "llama")
    with pytest.raises(ConfigError, match="--batch-invariant: not for a mixture of experts"):
        LLM(str(folder), batch_invariant=True, dtype="bfloat16")


def test_every_row_attends_alone() -> None:
    from kernels.attention.backend import AttentionMetadata
    from kernels.attention.cpu_backend import one_row_each

    # Two requests: 3 new rows after 2 cached tokens, then 1 decode row at position 5.
    tables = torch.tensor([[7, 8], [9, 0]], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(4),
        block_tables=tables,
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        seqlens_k=torch.tensor([5, 6], dtype=torch.int32),
        query_lens=[3, 1],
        context_lens=[5, 6],
    )
    rows = one_row_each(meta)
    assert rows.query_lens == [1, 1, 1, 1] and rows.context_lens == [3, 4, 5, 6]
    assert rows.seqlens_k.tolist() == [3, 4, 5, 6]
    assert rows.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert rows.block_tables.tolist() == [[7, 8], [7, 8], [7, 8], [9, 0]]
    assert one_row_each(meta) is rows  # planned once a step
