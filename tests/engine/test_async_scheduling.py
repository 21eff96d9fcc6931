"""Async scheduling (the next step scheduled while the model runs the current one) gives every
request exactly what the synchronous engine gives it, in float32: one workload run by both, under
a KV pool small enough to preempt and a token budget small enough to chunk, with every feature a
step touches; aborts and stop strings that end a sequence while its next step is already
running; and the flag's refusals."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from config import ConfigError, EngineConfig
from engine.async_scheduling.choice import use_async_scheduling
from engine.beam_search import BeamSearchParams
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.loading.model_spec import resolve_model_spec
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.structured import StructuredOutputsParams

BLOCK = 16
NUM_BLOCKS = 24  # 384 tokens for 8 sequences of up to ~180: preemption
BUDGET = 48  # tokens a step: prompts of up to 120 are chunked


def engine_settings(qwen3_dir: Path, async_scheduling: bool) -> dict[str, Any]:
    return {
        "model": str(qwen3_dir),
        "dtype": "float32",
        "block_size": BLOCK,
        "num_kv_blocks": NUM_BLOCKS,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": BUDGET,
        "async_scheduling": async_scheduling,
    }


@pytest.fixture(scope="module")
def engines(qwen3_dir: Path) -> dict[bool, LLM]:
    llms = {flag: LLM(**engine_settings(qwen3_dir, flag)) for flag in (False, True)}
    yield llms
    for llm in llms.values():
        llm.engine.close()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 5000, (n,), generator=g).tolist() for n in lengths]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}

WORKLOAD = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        seed=7,
        max_tokens=25,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        logprobs=3,
    ),
    SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, min_tokens=5),
    SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[1234, 200, 300]),
    SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=2, logprobs=1),
    SamplingParams(temperature=0.5, seed=11, top_k=20, top_p=0.9, min_p=0.01, max_tokens=33),
    SamplingParams(temperature=0, max_tokens=50, stop=["a", "e"]),
    SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
    ),
    SamplingParams(temperature=0.7, seed=5, max_tokens=18, logit_bias={50: 3.0}),
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    BeamSearchParams(beam_width=2, max_tokens=6).to_sampling_params(),
    SamplingParams(
        temperature=0.9, seed=1, max_tokens=45, stop=["\n"], include_stop_str_in_output=True
    ),
]
LENGTHS = [5, 40, 70, 17, 90, 33, 8, 64, 120, 3, 25, 48]


def comparable(outputs: list[RequestOutput]) -> list[Any]:
    return [
        (
            [
                (o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
                for o in r.outputs
            ],
            r.prompt_logprobs,
        )
        for r in outputs
    ]


def finished_counts(stats: EngineStats) -> list[tuple[str, int, int]]:
    return sorted(
        (f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in stats.finished
    )


def assert_pool_whole(engine: LLMEngine) -> None:
    assert not engine.requests
    assert engine.kv.pool.num_free == NUM_BLOCKS
    assert not any(engine.kv.tables.values())
    engine.kv.check_consistency()


def test_every_request_gets_what_the_synchronous_engine_gives(engines: dict[bool, LLM]) -> None:
    batch = prompts(LENGTHS, seed=0)
    results = {}
    for flag, llm in engines.items():
        outputs = llm.generate(batch, WORKLOAD)
        results[flag] = (comparable(outputs), llm.last_run_stats)
        assert_pool_whole(llm.engine)
    (sync_out, sync_stats), (async_out, async_stats) = results[False], results[True]
    assert async_out == sync_out
    assert engines[True].engine._pipeline is not None and engines[False].engine._pipeline is None
    # The workload reached what it is for: preemption and chunked prompts, under both.
    assert async_stats.num_preemptions > 0 and sync_stats.num_preemptions > 0
    assert max(async_stats.iteration_tokens) == BUDGET
    # Counted the same: tokens, and each request's end.
    assert async_stats.prompt_tokens == sync_stats.prompt_tokens
    assert async_stats.generation_tokens == sync_stats.generation_tokens
    assert finished_counts(async_stats) == finished_counts(sync_stats)
    assert {r for r, *_ in finished_counts(async_stats)} >= {"stop", "length"}


def run_with_abort(engine: LLMEngine, steps_before_abort: int) -> dict[str, RequestOutput]:
    """Three greedy requests; the second is aborted after `steps_before_abort` steps."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts([30, 50, 20], seed=4)):
        engine.add_request(prompt, greedy, request_id=f"r{i}")
    final: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == steps_before_abort:
            aborted = engine.abort_request("r1")
            assert isinstance(aborted, RequestOutput)
            final["r1"] = aborted
        for output in engine.step():
            assert isinstance(output, RequestOutput)
            assert output.request_id != "r1" or steps < steps_before_abort
            if output.finished:
                final[output.request_id] = output
        steps += 1
    return final


def test_an_abort_while_its_next_step_runs_drops_that_step(engines: dict[bool, LLM]) -> None:
    # Step 4: the aborted request is decoding, its next step already scheduled.
    sync = run_with_abort(engines[False].engine, 4)
    overlapped = run_with_abort(engines[True].engine, 4)
    for request_id in ("r0", "r2"):
        assert overlapped[request_id].outputs[0].token_ids == sync[request_id].outputs[0].token_ids
        assert len(overlapped[request_id].outputs[0].token_ids) == 24
    aborted, aborted_sync = overlapped["r1"].outputs[0], sync["r1"].outputs[0]
    assert aborted.finish_reason == aborted_sync.finish_reason == "abort"
    # Both had the same tokens so far; the overlapped engine's outputs trail its steps by one.
    assert 0 < len(aborted.token_ids) <= len(aborted_sync.token_ids) < 24
    assert aborted.token_ids == aborted_sync.token_ids[: len(aborted.token_ids)]
    assert_pool_whole(engines[True].engine)


def test_a_stop_string_ends_the_output_at_the_same_token(engines: dict[bool, LLM]) -> None:
    """The token scheduled after the one that completes the stop string is computed and
    discarded: never in the text, the token ids or the counts."""
    batch = prompts([12, 30], seed=9)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, stop=["o"]) for s in (2, 3)]
    sync, overlapped = (engines[f].generate(batch, params) for f in (False, True))
    assert comparable(overlapped) == comparable(sync)
    assert [r.outputs[0].finish_reason for r in sync] == ["stop", "stop"]
    assert_pool_whole(engines[True].engine)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"enable_lora": True}, "LoRA adapters are loaded into their slots between steps"),
        ({"runner": "pooling"}, "a pooling model's steps sample nothing"),
    ],
)
def test_the_flag_is_refused_where_steps_cannot_overlap(
    qwen3_dir: Path, settings: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ConfigError, match=f"--async-scheduling: {reason}"):
        LLM(**engine_settings(qwen3_dir, True) | settings)


def test_unset_it_is_off_on_the_cpu(qwen3_dir: Path) -> None:
    config = EngineConfig.from_kwargs(
        **engine_settings(qwen3_dir, True) | {"async_scheduling": None}
    )
    assert not use_async_scheduling(config, resolve_model_spec(config))


def test_a_dropped_engine_frees_its_model_and_ends_its_thread(qwen3_dir: Path) -> None:
    """An `LLM` that goes out of scope without close() must give its weights and KV cache back:
    on a GPU, the next engine sizes its pool from the memory left free. The model thread once
    kept the last step's function, and with it the executor, alive for good."""
    before = set(threading.enumerate())
    llm = LLM(**engine_settings(qwen3_dir, True))
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    executor = weakref.ref(llm.engine.executor)
    (thread,) = [
        t for t in set(threading.enumerate()) - before if t.name.startswith("pagedserve-model")
    ]
    del llm
    # The thread lets go of its last step a moment after handing its result over.
    deadline = time.monotonic() + 5.0
    while gc.collect() is not None and executor() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert executor() is None
    thread.join(2.0)
    assert not thread.is_alive()
