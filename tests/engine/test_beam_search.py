"""Beam search equals transformers' `generate(num_beams=k)`: tokens, order and scores, over
shared copy-on-write blocks, under chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.core.beam_search import length_divisor
from engine.core.scheduler import SchedulerOutput
from engine.errors import InvalidRequestError
from tests.conftest import SMALL_VOCAB
from tests.support.models import build_random_model, hf_beams, hf_greedy

BLOCK = 16
NUM_BLOCKS = 256
MAX_NEW = 10


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        100, 5000, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def assert_all_blocks_free(llm: LLM, num_blocks: int = NUM_BLOCKS) -> None:
    kv = llm.engine.kv
    assert kv.pool.num_free == num_blocks
    assert not any(kv.tables.values())
    kv.check_consistency()
    assert not llm.engine.scheduler.has_unfinished()


def assert_equals_transformers(
    llm: LLM,
    folder: Path,
    prompt: list[int],
    params: BeamSearchParams,
    stop_ids: list[int] | None = None,
) -> None:
    (ours,) = llm.beam_search([prompt], params)
    expected = hf_beams(
        folder,
        prompt,
        params.beam_width,
        params.max_tokens,
        params.length_penalty,
        params.early_stopping,
        stop_ids,
    )
    assert [s.output_token_ids for s in ours.sequences] == [t for t, _ in expected]
    for seq, (tokens, score) in zip(ours.sequences, expected):
        assert seq.tokens == prompt + tokens
        if params.beam_width > 1:  # transformers reports no score for a single beam
            # float32 scores: past |score| ~ 1000 (a negative length penalty) an ulp is 1e-4.
            assert seq.score == pytest.approx(score, abs=1e-4, rel=1e-6)
            # The cumulative logprob is the score times the length penalty's divisor.
            cum = score * len(tokens) ** params.length_penalty
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
    scores = [s.score for s in ours.sequences]
    assert scores == sorted(scores, reverse=True)


SETTINGS = [
    # (k, length_penalty, early_stopping)
    (1, 1.0, False),
    (2, 0.5, True),
    (4, 2.0, "never"),
    (4, -1.0, False),
    (8, 1.0, True),
    (8, 1.5, "never"),
]


@pytest.fixture(scope="module")
def small_vocab_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_dir with its tokenizer's first 8,192 ids, as small_vocab_qwen3_dir: the prompts draw
    from 100-4999, and every beam step ranks the whole vocabulary for every beam (here and in
    transformers), so the real tokenizers' 150k and 128k ids would cost more than the layers."""
    folder = tmp_path_factory.mktemp("llama")
    return build_random_model(folder, "llama", "llama", shard=True, vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"small_vocab_{request.param}_dir")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    # A small step budget: a 40-token prompt is prefilled in 3 chunks.
    return LLM(
        model=str(model),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"), SETTINGS)
def test_equals_transformers_under_chunked_prefill(
    llm: LLM, model: Path, k: int, length_penalty: float, early_stopping: bool | str
) -> None:
    prompt = random_prompt(40, seed=k)
    params = BeamSearchParams(
        beam_width=k,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    assert_equals_transformers(llm, model, prompt, params)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0, 1e308, -1e308])
def test_extreme_length_penalties_rank_without_overflow(llm: LLM, length_penalty: float) -> None:
    """7 ** 1000 is past float64: the divisor is inf (every score -0.0), or for -1000 it is
    below float32's range (every score -inf), never an OverflowError or a NaN. Every hypothesis
    here ends at the length limit, where any penalty divides all of them alike: the ranking is
    the one by summed logprob, which length_penalty 1 gives (checked against transformers
    above)."""
    prompt = [5, 6, 7, 8]

    def search(penalty: float) -> list[tuple[list[int], float]]:
        params = BeamSearchParams(2, 6, ignore_eos=True, length_penalty=penalty)
        (out,) = llm.beam_search([prompt], params)
        assert not any(math.isnan(s.score) for s in out.sequences)
        return [(s.output_token_ids, s.cum_logprob) for s in out.sequences]

    assert search(length_penalty) == search(1.0)
    assert_all_blocks_free(llm)


def test_length_divisor_stays_in_float32s_range() -> None:
    assert length_divisor(3, 2.0) == 9.0  # as transformers computes it, while it can
    assert length_divisor(7, 1000.0) == math.inf  # 7.0 ** 1000 raises OverflowError
    assert length_divisor(7, -1000.0) == 2.0**-149  # 0.0 underflowed: 0 / 0 would be NaN
    assert (torch.tensor([0.0, -1.0]) / length_divisor(7, -1000.0)).isnan().sum() == 0


def best_without_stops(llm: LLM, prompt: list[int], k: int) -> list[int]:
    (probe,) = llm.beam_search([prompt], BeamSearchParams(k, MAX_NEW, ignore_eos=True))
    return probe.sequences[0].output_token_ids


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_stop_tokens_finish_hypotheses_as_transformers_does(
    llm: LLM, model: Path, k: int, early_stopping: bool | str
) -> None:
    prompt = random_prompt(21, seed=100 + k)
    # A token the search is sure to meet: the best beam's third token, without stop tokens.
    unstopped = best_without_stops(llm, prompt, k)
    stop = unstopped[2]
    params = BeamSearchParams(
        beam_width=k,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        length_penalty=1.0,
        early_stopping=early_stopping,
        stop_token_ids=[stop],
    )
    assert_equals_transformers(llm, model, prompt, params, stop_ids=[stop])
    (ours,) = llm.beam_search([prompt], params)
    # That beam now ends at its third token: the stop token changed the search.
    assert all(s.output_token_ids != unstopped for s in ours.sequences)
    for s in ours.sequences:
        if s.finish_reason == "stop":
            assert s.output_token_ids[-1] == stop and s.stop_reason == stop
            assert stop not in s.output_token_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.output_token_ids) == MAX_NEW
            assert stop not in s.output_token_ids
    assert_all_blocks_free(llm)


def test_one_beam_is_greedy(llm: LLM, model: Path) -> None:
    prompt = random_prompt(33, seed=7)
    (beam,) = llm.beam_search([prompt], BeamSearchParams(1, MAX_NEW, ignore_eos=True))
    (greedy,) = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    )
    assert beam.sequences[0].output_token_ids == greedy.outputs[0].token_ids
    assert greedy.outputs[0].token_ids == hf_greedy(model, [prompt], MAX_NEW)[0]


def test_prefix_cache_serves_the_prompt_and_changes_nothing(llm: LLM, model: Path) -> None:
    prompt = random_prompt(3 * BLOCK + 5, seed=11)
    params = BeamSearchParams(4, MAX_NEW, ignore_eos=True).to_sampling_params()
    (first,) = llm.generate(prompt, params)
    (second,) = llm.generate(prompt, params)
    assert second.num_cached_tokens == 3 * BLOCK
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    assert [o.cumulative_logprob for o in second.outputs] == pytest.approx(
        [o.cumulative_logprob for o in first.outputs], abs=1e-5
    )
    expected = hf_beams(model, prompt, 4, MAX_NEW)
    assert [o.token_ids for o in second.outputs] == [t for t, _ in expected]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_beams_recompute_to_the_same_result(
    small_vocab_qwen3_dir: Path, caching: bool
) -> None:
    """Three searches and two greedy requests in a pool that holds one search at full length
    unshared: beams are preempted and recomputed, and every result is still transformers'."""
    block, k = 4, 4
    prompts = [random_prompt(21, seed=200 + i) for i in range(3)]
    num_blocks = k * -(-(21 + MAX_NEW) // block)  # the least the admission check accepts
    llm = LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=block,
        num_kv_blocks=num_blocks,
        max_model_len=64,
        max_num_seqs=16,
        enable_prefix_caching=caching,
    )
    engine = llm.engine
    beam = BeamSearchParams(k, MAX_NEW, ignore_eos=True, length_penalty=0.7).to_sampling_params()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [engine.add_request(p, beam) for p in prompts]
    greedy_ids = [engine.add_request(p, greedy) for p in prompts[:2]]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.kv.check_consistency()
    stats = engine.take_stats()
    assert stats.num_preemptions > 0, "the pool was not short: nothing was preempted"
    for request_id, prompt in zip(ids, prompts):
        expected = hf_beams(small_vocab_qwen3_dir, prompt, k, MAX_NEW, length_penalty=0.7)
        assert [o.token_ids for o in final[request_id].outputs] == [t for t, _ in expected]
        for o, (tokens, score) in zip(final[request_id].outputs, expected):
            assert o.cumulative_logprob == pytest.approx(score * len(tokens) ** 0.7, abs=1e-3)
    for request_id, prompt in zip(greedy_ids, prompts):
        assert (
            final[request_id].outputs[0].token_ids
            == hf_greedy(small_vocab_qwen3_dir, [prompt], MAX_NEW)[0]
        )
    assert_all_blocks_free(llm, num_blocks)


def test_beams_hold_the_prompts_full_blocks_once(small_vocab_qwen3_dir: Path) -> None:
    """k beams over a 600-token prompt: its 37 full blocks are in the pool once, shared by
    every beam (ref count k), not k times; pruned beams give theirs back at once."""
    k, prompt_len, max_new = 4, 600, 24
    full = prompt_len // BLOCK  # 37 full blocks, then 8 tokens in a partial one
    llm = LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=1024,
        max_num_seqs=8,
    )
    engine, kv = llm.engine, llm.engine.kv
    prompt = random_prompt(prompt_len, seed=3)
    engine.add_request(prompt, BeamSearchParams(k, max_new, ignore_eos=True).to_sampling_params())
    in_use: list[int] = []
    copies = 0
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        nonlocal copies
        out = schedule()
        copies += len(out.block_copies)
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            kv.check_consistency()
            in_use.append(NUM_BLOCKS - kv.pool.num_free)
            live = [t for t in kv.tables.values() if t]
            if len(live) == k:
                # Every beam's table starts with the same 37 blocks, each referenced k times.
                assert all(t[:full] == live[0][:full] for t in live)
                assert all(kv.pool.ref_cnt[b] == k for b in live[0][:full])
    finally:
        del engine.scheduler.schedule
    (result,) = outputs
    assert len(result.outputs) == k
    # At most: the prompt's full blocks once, and each beam's own tail (the shared partial
    # block copied on write, then the blocks its 24 new tokens fill): 8 + 24 tokens = 2 blocks.
    tail = -(-(prompt_len % BLOCK + max_new) // BLOCK)
    assert max(in_use) <= full + k * tail
    assert max(in_use) < k * full  # unshared, the prompt alone would take 148
    assert copies > 0  # the shared partial block was copied when beams diverged inside it
    assert_all_blocks_free(llm)


def test_abort_frees_every_beam(small_vocab_qwen3_dir: Path) -> None:
    llm = LLM(
        model=str(small_vocab_qwen3_dir), block_size=BLOCK, num_kv_blocks=64, max_model_len=256
    )
    engine = llm.engine
    request_id = engine.add_request(
        random_prompt(40, seed=5), BeamSearchParams(4, 50, ignore_eos=True).to_sampling_params()
    )
    for _ in range(5):
        engine.step()
    assert len([t for t in engine.kv.tables.values() if t]) == 4
    aborted = engine.abort_request(request_id)
    assert aborted is not None and aborted.finished
    assert engine.take_stats().finished[-1].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm, 64)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"logprobs": 2}, "logprobs"),
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 64}, "n"),  # more beams than the pool can hold at full length
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": float("inf")}, "length_penalty"),
        ({"length_penalty": float("-inf")}, "length_penalty"),
    ],
)
def test_bad_beam_requests_name_the_field(
    small_vocab_qwen3_dir: Path, params: dict, field: str
) -> None:
    llm = LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=256,
        max_num_seqs=64,
    )
    base = {"n": 2, "use_beam_search": True, "temperature": 0.0, "max_tokens": 20}
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(random_prompt(10, seed=1), SamplingParams(**{**base, **params}))
    assert err.value.param == field
    assert_all_blocks_free(llm, 64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_reads_the_copied_blocks(
    small_vocab_qwen3_dir: Path, backend: str
) -> None:
    """The beams' shared partial prompt block (21 tokens: 16 + 5) is copied on the first
    divergent write, before the step's forward pass, whatever backend then reads it."""
    llm = LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=128,
        attention_backend=backend,
    )
    params = BeamSearchParams(4, 6, ignore_eos=True, length_penalty=0.5)
    assert_equals_transformers(llm, small_vocab_qwen3_dir, random_prompt(21, seed=21), params)
    assert_all_blocks_free(llm, 64)


def test_beams_and_samples_in_one_batch(small_vocab_qwen3_dir: Path) -> None:
    """Ordinary requests that finish mid-search, in the steps the beams step in, leave the
    search alone, and the search leaves their tokens alone."""
    llm = LLM(
        model=str(small_vocab_qwen3_dir), block_size=BLOCK, num_kv_blocks=128, max_model_len=256
    )
    engine = llm.engine
    prompt = random_prompt(25, seed=9)
    beam_id = engine.add_request(
        prompt, BeamSearchParams(4, MAX_NEW, ignore_eos=True).to_sampling_params()
    )
    short = [
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for n in (1, 2, 5)
    ]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    expected = hf_beams(small_vocab_qwen3_dir, prompt, 4, MAX_NEW)
    assert [o.token_ids for o in final[beam_id].outputs] == [t for t, _ in expected]
    greedy = hf_greedy(small_vocab_qwen3_dir, [prompt], 5)[0]
    for request_id, n in zip(short, (1, 2, 5)):
        assert final[request_id].outputs[0].token_ids == greedy[:n]
    assert_all_blocks_free(llm, 128)


def test_searches_keep_within_max_num_seqs(small_vocab_qwen3_dir: Path) -> None:
    """A search admitted with one sequence forks up to its width: those seats are reserved, so
    two width-4 searches under --max-num-seqs 4 run one after the other, never 8 at once, and
    both still equal transformers."""
    llm = LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=BLOCK,
        num_kv_blocks=128,
        max_model_len=256,
        max_num_seqs=4,
    )
    engine = llm.engine
    prompts = [random_prompt(20, seed=11), random_prompt(30, seed=12)]
    ids = [
        engine.add_request(p, BeamSearchParams(4, MAX_NEW, ignore_eos=True).to_sampling_params())
        for p in prompts
    ]
    most, final = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    assert most == 4
    # Each live beam generates a token a step: the root alone first, then all four.
    assert engine.take_stats().generation_tokens == 2 * (1 + 4 * (MAX_NEW - 1))
    for request_id, prompt in zip(ids, prompts):
        expected = hf_beams(small_vocab_qwen3_dir, prompt, 4, MAX_NEW)
        assert [o.token_ids for o in final[request_id].outputs] == [t for t, _ in expected]
    assert_all_blocks_free(llm, 128)


def test_a_search_says_it_started_at_its_first_step(small_vocab_qwen3_dir: Path) -> None:
    """The step of its first token hands back an output of no choices, not finished (what ends
    a request's wait in the server's admission queue); the answer comes once, at the end."""
    llm = LLM(
        model=str(small_vocab_qwen3_dir), block_size=BLOCK, num_kv_blocks=64, max_model_len=256
    )
    engine = llm.engine
    request_id = engine.add_request(
        random_prompt(20, seed=13), BeamSearchParams(2, 5, ignore_eos=True).to_sampling_params()
    )
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.finished, len(o.outputs)) for o in engine.step() if o.request_id == request_id]
    assert seen == [(False, 0), (True, 2)]
