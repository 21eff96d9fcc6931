"""Sample and prompt logprobs against transformers: every reported value is log_softmax of
transformers' float32 logits at the right position, through batching, chunked prefill and
prefix caching."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.outputs import PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams

ATOL = 1e-4
LONG_PROMPT = (
    "In the middle of the valley stood an old mill whose wheel had not turned for many years, "
    "and the children of the village told each other stories about the miller who had vanished "
    "one winter night without a word to anyone"
)


class Reference:
    """transformers' log_softmax over the whole sequence, from one forward pass per sequence."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.eval()
        self._last: tuple[list[int], torch.Tensor] | None = (
            None  # rows are [tokens, 150k]: keep one
        )

    @torch.no_grad()
    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: row p is the distribution of the token after position p."""
        if self._last is None or self._last[0] != token_ids:
            logits = self.model(torch.tensor([token_ids])).logits[0].float()
            self._last = (list(token_ids), torch.log_softmax(logits, dim=-1))
        return self._last[1]


def assert_position(
    reported: PositionLogprobs | None, expected_row: torch.Tensor, token: int, top_n: int
) -> None:
    """The chosen token first, then the `top_n` most likely tokens in rank order (the chosen
    token is not repeated when it is one of them), each with transformers' logprob."""
    assert reported is not None
    ids = list(reported)
    assert ids[0] == token
    for token_id, value in reported.items():
        assert value == pytest.approx(float(expected_row[token_id]), abs=ATOL), token_id
    top = expected_row.topk(top_n + 1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    token_in_top = len(ids) == top_n and top_n > 0
    assert len(ids) == top_n + (not token_in_top)
    alternatives = ids if token_in_top else ids[1:]
    if top_n:
        boundary = top_values[top_n - 1]
        if token_in_top:
            assert float(expected_row[token]) >= boundary - ATOL
        else:
            assert float(expected_row[token]) <= boundary + ATOL
    values = [reported[i] for i in alternatives]
    assert sorted(values, reverse=True) == pytest.approx(top_values[:top_n], abs=ATOL)
    after_token = [reported[i] for i in ids[1:]]
    assert all(a >= b - ATOL for a, b in itertools.pairwise(after_token))  # rank order
    if top_n and top_values[top_n - 1] - top_values[top_n] > ATOL:  # no near-tie at the cut
        assert set(alternatives) == set(top_ids[:top_n])


def check_sample_logprobs(out: RequestOutput, ref: Reference, top_n: int) -> None:
    for completion in out.outputs:
        tokens = completion.token_ids
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
        expected = ref.logprobs(out.prompt_token_ids + tokens)
        for k, (token, reported) in enumerate(zip(tokens, completion.logprobs)):
            assert_position(reported, expected[len(out.prompt_token_ids) + k - 1], token, top_n)


def check_prompt_logprobs(out: RequestOutput, ref: Reference, top_n: int) -> None:
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing to predict the first token from
    expected = ref.logprobs(prompt)
    for i in range(1, len(prompt)):
        assert_position(out.prompt_logprobs[i], expected[i - 1], prompt[i], top_n)


@pytest.fixture(scope="module")
def ref(qwen3_dir: Path) -> Reference:
    return Reference(qwen3_dir)


@pytest.fixture(scope="module")
def llm(qwen3_dir: Path) -> LLM:
    return LLM(str(qwen3_dir), max_model_len=256, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def chunked_llm(qwen3_dir: Path) -> LLM:
    """Prompts of ~50 tokens take several steps; full blocks go into the prefix cache."""
    return LLM(
        str(qwen3_dir),
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )


def test_greedy_logprobs_match_transformers(llm: LLM, ref: Reference) -> None:
    greedy = SamplingParams(temperature=0, logprobs=5, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["Hello there, how are you", "One"], greedy)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 8
        check_sample_logprobs(out, ref, top_n=5)
        # Greedy: each token is transformers' most likely one (up to float noise).
        expected = ref.logprobs(out.prompt_token_ids + out.outputs[0].token_ids)
        for k, token in enumerate(out.outputs[0].token_ids):
            row = expected[len(out.prompt_token_ids) + k - 1]
            assert float(row[token]) >= float(row.max()) - ATOL


def test_sampled_and_zero_logprobs_in_one_batch(llm: LLM, ref: Reference) -> None:
    """A sampled token is often outside the top 5: it comes first, then the full top 5.
    logprobs=0 reports the chosen token alone. Logprobs are those of the raw distribution,
    before temperature and top-k."""
    sampled = SamplingParams(
        temperature=1.5, top_k=1000, seed=5, logprobs=5, max_tokens=6, ignore_eos=True
    )
    alone = SamplingParams(temperature=0, logprobs=0, max_tokens=6, ignore_eos=True)
    pair = SamplingParams(temperature=1.0, n=2, seed=11, logprobs=2, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["Tell me a story", "Numbers: 1 2 3", "Why"], [sampled, alone, pair])
    check_sample_logprobs(outs[0], ref, top_n=5)
    assert any(
        len(position) == 6 for position in outs[0].outputs[0].logprobs
    )  # a token outside the top 5
    check_sample_logprobs(outs[1], ref, top_n=0)
    assert len(outs[2].outputs) == 2
    check_sample_logprobs(outs[2], ref, top_n=2)


def test_prompt_logprobs_match_transformers(llm: LLM, ref: Reference) -> None:
    params = SamplingParams(temperature=0, prompt_logprobs=3, max_tokens=2, ignore_eos=True)
    outs = llm.generate(["The capital of France is Paris and", LONG_PROMPT], params)
    for out in outs:
        check_prompt_logprobs(out, ref, top_n=3)
    # prompt_logprobs=0: the prompt token alone at each position
    out = llm.generate("Short prompt here", SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    check_prompt_logprobs(out, ref, top_n=0)


def test_prompt_and_sample_logprobs_across_prefill_chunks(chunked_llm: LLM, ref: Reference) -> None:
    prompt_ids = chunked_llm.tokenizer(LONG_PROMPT).input_ids
    assert len(prompt_ids) >= 40  # several 16-token chunks
    params = SamplingParams(
        temperature=0, prompt_logprobs=3, logprobs=3, max_tokens=4, ignore_eos=True
    )
    # Two long prompts share the 16-token budget: each one's chunks interleave with the other's.
    other = (
        "A different text entirely, which is also long enough to need a few chunks of prefill work"
    )
    outs = chunked_llm.generate([LONG_PROMPT, other], params)
    for out in outs:
        check_prompt_logprobs(out, ref, top_n=3)
        check_sample_logprobs(out, ref, top_n=3)


def test_prompt_logprobs_are_complete_with_prefix_caching(chunked_llm: LLM, ref: Reference) -> None:
    tokens = chunked_llm.tokenizer(LONG_PROMPT).input_ids
    prefix = tokens[:40]  # two full blocks of 16 and part of a third
    first = prefix + chunked_llm.tokenizer(" and then the mill burned").input_ids
    second = prefix + chunked_llm.tokenizer(" so nobody ever went there again").input_ids
    assert first[:40] == second[:40] and first != second
    chunked_llm.generate([first], SamplingParams(max_tokens=1))  # fills the prefix cache

    params = SamplingParams(temperature=0, prompt_logprobs=3, max_tokens=2, ignore_eos=True)
    out = chunked_llm.generate([second], params)[0]
    check_prompt_logprobs(out, ref, top_n=3)

    # Two requests sharing the prefix in one batch, one with prompt logprobs and one without.
    outs = chunked_llm.generate([first, second], [SamplingParams(max_tokens=2), params])
    check_prompt_logprobs(outs[1], ref, top_n=3)
    assert outs[0].prompt_logprobs is None

    # The cache really holds the prefix: a plain request sharing it is served from it.
    chunked_llm.generate([second], SamplingParams(max_tokens=1))
    assert chunked_llm.last_run_stats.prefix_cache_hits >= 32
    chunked_llm.engine.kv.check_consistency()


def test_prompt_logprobs_survive_preemption_mid_prompt(
    qwen3_dir: Path, ref: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 7-block pool: a 90-token prompt (6 blocks) is preempted in its last prefill chunk when a
    short decoding request takes its second block; recomputed from scratch, it must neither lose
    nor duplicate the prompt logprobs gathered before."""
    llm = LLM(
        str(qwen3_dir), max_model_len=96, num_kv_blocks=7, block_size=16, max_num_batched_tokens=16
    )
    scheduler = llm.engine.scheduler
    preempted_mid_prompt: list[tuple[int, int]] = []
    preempt = scheduler._preempt

    def record(request, reason: str) -> None:
        if (
            request.prompt_logprobs is not None
            and request.num_computed_tokens < request.num_prompt_tokens
        ):
            preempted_mid_prompt.append((request.num_computed_tokens, len(request.prompt_logprobs)))
        preempt(request, reason)

    monkeypatch.setattr(scheduler, "_preempt", record)
    ids = llm.tokenizer(LONG_PROMPT * 3).input_ids
    short, long = ids[:14], ids[5:95]
    outs = llm.generate(
        [short, long],
        [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(
                temperature=0, prompt_logprobs=3, logprobs=2, max_tokens=4, ignore_eos=True
            ),
        ],
    )
    # It was preempted with part of its prompt logprobs already gathered.
    assert any(1 < gathered < len(long) for _, gathered in preempted_mid_prompt), (
        preempted_mid_prompt
    )
    check_prompt_logprobs(outs[1], ref, top_n=3)
    check_sample_logprobs(outs[1], ref, top_n=2)
    assert llm.engine.kv.pool.num_free == 7
