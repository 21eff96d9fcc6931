"""Speculative decoding by prompt lookup (n-gram) gives every request exactly what the engine
gives it without speculation, in float32: greedy and seeded requests alike (verification samples
the target at each drafted position in turn, so a seeded request draws the same numbers), under a
pool small enough to preempt and a budget small enough to chunk; stop strings, stop tokens and
max_tokens cut the accepted tokens where they must; the counts obey vLLM's identities; and bad
settings are refused naming the key."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from config import ConfigError, EngineConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import Sample
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import lookup
from engine.stats import EngineStats
from engine.structured import StructuredOutputsParams

BLOCK = 16
NUM_BLOCKS = 24  # 384 tokens for 8 sequences of up to ~180: preemption
BUDGET = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def settings(model_dir: Path, speculative: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "block_size": BLOCK,
        "num_kv_blocks": NUM_BLOCKS,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": BUDGET,
        "speculative_config": speculative,
    }


@pytest.fixture(scope="module")
def engines(qwen3_dir: Path) -> dict[bool, LLM]:
    llms = {flag: LLM(**settings(qwen3_dir, NGRAM if flag else None)) for flag in (False, True)}
    yield llms
    for llm in llms.values():
        llm.engine.close()


def repetitive_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase: prompt lookup finds its drafts in them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        phrase = torch.randint(100, 5000, (max(2, n // 4),), generator=g).tolist()
        out.append((phrase * 5)[:n])
    return out


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}

WORKLOAD = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
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
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, min_tokens=30),
    SamplingParams(
        temperature=0.9, seed=1, max_tokens=45, stop=["\n"], include_stop_str_in_output=True
    ),
]
LENGTHS = [5, 40, 70, 17, 90, 33, 8, 64, 120, 3, 25, 48]


def comparable(outputs: list[RequestOutput]) -> list[Any]:
    return [
        (
            [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs],
            r.prompt_logprobs is not None,
        )
        for r in outputs
    ]


def logprobs_of(outputs: list[RequestOutput]) -> list[tuple[int, float]]:
    """Every reported (token, logprob), flattened in order."""
    return [
        (token, value)
        for r in outputs
        for o in r.outputs
        for position in o.logprobs or []
        for token, value in position.items()
    ]


def assert_pool_whole(engine: LLMEngine) -> None:
    assert not engine.requests
    assert engine.kv.pool.num_free == NUM_BLOCKS
    assert not any(engine.kv.tables.values())
    engine.kv.check_consistency()


BATCH = repetitive_prompts(LENGTHS, seed=0)


@dataclass(frozen=True)
class PlainRun:
    outputs: list[RequestOutput]
    stats: EngineStats


@pytest.fixture(scope="module")
def plain(engines: dict[bool, LLM]) -> PlainRun:
    """The workload without speculation, once: what both the n-gram drafts and the oracle's
    must give."""
    outputs = engines[False].generate(BATCH, WORKLOAD)
    assert_pool_whole(engines[False].engine)
    return PlainRun(outputs, engines[False].last_run_stats)


def test_every_request_gets_what_it_gets_without_speculation(
    engines: dict[bool, LLM], plain: PlainRun
) -> None:
    spec = engines[True].generate(BATCH, WORKLOAD)
    spec_stats, plain_stats = engines[True].last_run_stats, plain.stats
    assert_pool_whole(engines[True].engine)
    assert comparable(spec) == comparable(plain.outputs)
    # Logprobs of rows computed several at a time agree to float32 rounding.
    got, want = logprobs_of(spec), logprobs_of(plain.outputs)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert torch.allclose(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), atol=1e-4
    )
    # Speculation ran, was verified, and the workload preempted and chunked.
    drafts = spec_stats.spec_decode
    assert drafts.num_drafts > 0 and 0 < drafts.num_accepted_tokens <= drafts.num_draft_tokens
    assert spec_stats.generation_tokens == plain_stats.generation_tokens
    assert plain_stats.spec_decode.num_drafts == 0
    assert max(spec_stats.iteration_tokens) == BUDGET


def test_counts_obey_vllms_identities(engines: dict[bool, LLM]) -> None:
    llm = engines[True]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate(repetitive_prompts([30, 12, 50], seed=4), greedy)
    stats = llm.last_run_stats.spec_decode
    per_position = stats.accepted_per_position
    assert stats.num_accepted_tokens == sum(per_position) > 0
    assert all(a >= b for a, b in itertools.pairwise(per_position))
    assert len(per_position) <= NGRAM["num_speculative_tokens"]
    assert per_position[0] <= stats.num_drafts
    assert stats.num_draft_tokens <= stats.num_drafts * NGRAM["num_speculative_tokens"]


def test_no_token_past_max_tokens_or_a_stop_string(engines: dict[bool, LLM]) -> None:
    """A prompt that repeats one phrase: the drafts copy it, and whatever they guess past a
    limit is never shown."""
    phrase = [1000 + i for i in range(6)]
    prompt = phrase * 6
    for params in (
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 4, 5, 9)
    ):
        plain, spec = (engines[f].generate([prompt], params)[0].outputs[0] for f in (False, True))
        assert spec.token_ids == plain.token_ids and len(spec.token_ids) == params.max_tokens
    text = engines[False].generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    stop = text.outputs[0].text[5:7]
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=include
        )
        plain, spec = (engines[f].generate([prompt], params)[0].outputs[0] for f in (False, True))
        assert (spec.text, spec.token_ids, spec.finish_reason) == (
            plain.text,
            plain.token_ids,
            plain.finish_reason,
        )
    assert_pool_whole(engines[True].engine)


def test_lookup_takes_the_longest_latest_match() -> None:
    tokens = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert lookup(tokens, 2, 5, 3) == [4, 5, 9]
    assert lookup(np.array([7, 1, 8, 1, 9, 1]), 1, 1, 2) == [9, 1]  # the latest of three
    assert lookup(np.array([7, 8]), 1, 3, 2) == []
    assert lookup(np.array([1, 2, 3, 9, 2, 3]), 3, 3, 2) == []  # shorter than the minimum


def test_beam_search_is_refused(engines: dict[bool, LLM]) -> None:
    engine = engines[True].engine
    params = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="speculative") as info:
        engine.check([1, 2, 3], params)
    assert info.value.param == "use_beam_search"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "colour": 1}', "colour"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model"),
        ('{"num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}', "draft_tensor"),
        ("not json", "JSON"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(value: str, named: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as info:
        EngineConfig.from_kwargs(speculative_config=value)
    assert named in str(info.value)


def test_async_scheduling_is_refused_with_the_reason(qwen3_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"--async-scheduling: .*--speculative-config"):
        LLMEngine(EngineConfig.from_kwargs(**settings(qwen3_dir, NGRAM), async_scheduling=True))


class OracleProposer:
    """Drafts that are the tokens each sequence gets without speculation, with every third
    draft's second token made wrong: verification then accepts whole drafts, takes the bonus
    token after them, and rejects mid-draft, for greedy and seeded requests alike."""

    def __init__(self, reference: dict[tuple[tuple[int, ...], int], list[int]]) -> None:
        self.reference = reference
        self.calls = 0

    def propose(self, seqs: list[Any], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, max_drafts):
            done = seq.num_output_tokens
            draft = list(self.reference[(tuple(seq.prompt_token_ids), seq.index)][done : done + k])
            self.calls += 1
            if self.calls % 3 == 0 and len(draft) > 1:
                draft[1] = (draft[1] + 1) % 5000
            drafts.append(draft)
        return drafts

    def close(self) -> None:
        pass


def test_right_drafts_are_accepted_and_wrong_ones_cut(
    engines: dict[bool, LLM], plain: PlainRun
) -> None:
    reference = {
        (tuple(r.prompt_token_ids), o.index): o.token_ids for r in plain.outputs for o in r.outputs
    }
    speculator = engines[True].engine.speculator
    assert speculator is not None
    ngram, speculator.proposer = speculator.proposer, OracleProposer(reference)
    try:
        spec = engines[True].generate(BATCH, WORKLOAD)
    finally:
        speculator.proposer = ngram
    assert comparable(spec) == comparable(plain.outputs)
    got, want = logprobs_of(spec), logprobs_of(plain.outputs)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert torch.allclose(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), atol=1e-4
    )
    stats = engines[True].last_run_stats
    assert stats.num_preemptions > 0  # drafts of preempted sequences were dropped, not run
    drafts = stats.spec_decode
    # Most drafts are right: whole drafts accepted, then the bonus token.
    assert drafts.num_accepted_tokens > drafts.num_draft_tokens / 2
    assert len(drafts.accepted_per_position) == 3 and drafts.accepted_per_position[2] > 0
    assert drafts.num_accepted_tokens < drafts.num_draft_tokens  # the wrong ones were cut
    assert len(stats.iteration_tokens) < len(plain.stats.iteration_tokens)
    assert_pool_whole(engines[True].engine)


def test_guesses_never_preempt_anyone() -> None:
    """A sequence whose guesses need a block the pool lacks runs its own token alone; with the
    block free, its guesses run with it."""
    for num_blocks, drafted in ((2, False), (3, True)):
        kv = KVCacheManager(num_blocks, 4, enable_caching=False)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
        params = SamplingParams(temperature=0, max_tokens=10)
        seqs = [Sequence(f"s{i}", f"s{i}", 0, [7, 8, 9], params, float(i)) for i in range(2)]
        for seq in seqs:
            scheduler.add(seq)
        prompt_step = scheduler.schedule()
        scheduler.update_from_output(prompt_step, [Sample(5, None), Sample(6, None)], 100)
        seqs[0].spec_token_ids = [1, 2, 3]  # positions 3-6: a second block
        out = scheduler.schedule()
        assert out.preempted == [] and [s.seq for s in out.scheduled] == seqs
        first = out.scheduled[0]
        assert first.draft_token_ids == ([1, 2, 3] if drafted else [])
        assert first.num_new_tokens == (4 if drafted else 1)
        assert seqs[0].spec_token_ids == []  # consumed either way
