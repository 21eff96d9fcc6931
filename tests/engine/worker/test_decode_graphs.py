"""Decode steps through the CUDA-graph path: padded to a captured batch size and fed from static
buffers. On a CPU nothing is captured, but the same buffers feed the model eagerly, so what the
graphs would read (padding, stale buffer contents, block tables) is checked here against the
plain path; tests/gpu/test_gpu.py checks the replayed graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cuda_graphs import DecodeGraphs, graph_sizes, pad_decode
from engine.worker.model_input import HostBatch
from tests.support.models import folder_tokenizer
from tests.support.prompts import shared_prefix_prompts


def test_graph_sizes_climb_the_ladder_to_max_num_seqs() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_sizes(4096)[-3:] == [384, 448, 512]


def test_pad_decode_adds_requests_that_store_nothing() -> None:
    batch = HostBatch(
        input_ids=[5, 6, 7],
        positions=[9, 0, 40],
        slots=[25, 32, 104],
        query_lens=[1, 1, 1],
        context_lens=[10, 1, 41],
        block_tables=torch.tensor([[1, 2, 0], [4, 0, 0], [3, 5, 6]], dtype=torch.int32),
        logits_indices=[0, 1, 2],
        block_copies=[(2, 7)],
    )
    padded = pad_decode(batch, 8, 5)
    assert padded.input_ids == [5, 6, 7, 0, 0, 0, 0, 0] and padded.positions == [9, 0, 40] + [0] * 5
    assert padded.slots == [25, 32, 104] + [-1] * 5
    assert padded.query_lens == [1] * 8 and padded.context_lens == [10, 1, 41] + [1] * 5
    assert padded.block_tables.shape == (8, 5) and padded.block_tables.dtype == torch.int32
    assert padded.block_tables[:3, :3].tolist() == batch.block_tables.tolist()
    assert (
        int(padded.block_tables[3:].abs().sum()) == 0
        and int(padded.block_tables[:, 3:].abs().sum()) == 0
    )
    assert padded.logits_indices == [0, 1, 2] and padded.block_copies == [(2, 7)]


@pytest.mark.parametrize(
    ("model_fixture", "backend"), [("llama_dir", "torch"), ("qwen3_dir", "triton")]
)
def test_padded_decode_steps_give_the_same_tokens(
    model_fixture: str, backend: str, request, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked, preempted and prefix-cached (as tests/kernels/attention/test_triton_kernels.py runs them), with
    every decode step padded: 5 requests, so steps of 5, 4, 3... rows run as 6, 4, 4, ..."""
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = folder_tokenizer(model_dir)
    prompts = [p[:70] for p in shared_prefix_prompts(tokenizer, prefix_len=40)][:5]
    # The chosen tokens' logprobs too: greedy tokens of a small random model barely depend on
    # attention, its logprobs do (decode rows at position 0 would still pick the same tokens).
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True, logprobs=0)
        for i in range(5)
    ]
    settings = {
        "max_num_batched_tokens": 24,
        "num_kv_blocks": 12,
        "block_size": 16,
        "max_model_len": 128,
        "max_num_seqs": 6,
        "attention_backend": backend,
    }
    # The unpadded run on the torch reference: the Triton backend matches it on this workload
    # (tests/kernels/attention/test_triton_kernels.py), and it runs without the interpreter.
    plain = LLM(str(model_dir), **{**settings, "attention_backend": "torch"})
    want = plain.generate(prompts, params)

    llm = LLM(str(model_dir), **settings)
    runner = llm.engine.executor.runner
    assert runner.graphs is None  # no CUDA: decode runs eagerly unless told otherwise
    graphs = DecodeGraphs(
        runner.model, runner.device, runner.backend, runner.kv_caches, 6, 128 // 16, capture=False
    )
    runner.graphs = graphs
    sizes: list[tuple[int, int]] = []
    run = graphs.run

    def recorded(batch: HostBatch, upload):
        n = len(batch.query_lens)
        sizes.append((n, next(s for s in graphs.sizes if s >= n)))
        return run(batch, upload)

    graphs.run = recorded
    widths: list[tuple[int, int]] = []

    def narrow(batch: HostBatch, size: int, width: int) -> HostBatch:
        widths.append((batch.block_tables.shape[1], width))
        return pad_decode(batch, size, width)

    monkeypatch.setattr("engine.worker.cuda_graphs.pad_decode", narrow)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        got_lp = [next(iter(p.values())) for p in g.outputs[0].logprobs]
        want_lp = [next(iter(p.values())) for p in w.outputs[0].logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-5)
    assert llm.last_run_stats.num_preemptions > 0 and llm.last_run_stats.prefix_cache_hits > 0
    assert any(n < size for n, size in sizes), sizes  # some steps were padded
    assert {n for n, _ in sizes} >= {1, 2}
    # Only the columns the step uses travel, and the buffer's stale columns change nothing above.
    assert all(used == sent for used, sent in widths) and min(w for w, _ in widths) < 128 // 16
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
