"""Sampling: seeded reproducibility inside any batch, the exact support of top-k / top-p / min-p,
penalties and logit bias as OpenAI and vLLM define them, and SamplingParams validation."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, apply_logit_bias, apply_penalties

VOCAB = 50


def make_sequence(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> Sequence:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    seq = Sequence(
        seq_id="r",
        request_id="r",
        index=0,
        prompt_token_ids=prompt or [0, 1, 2],
        params=params,
        arrival_time=0.0,
        generator=generator,
    )
    for token in output or []:
        seq.append_token(token)
    return seq


def geometric_logits() -> torch.Tensor:
    """p(rank r) proportional to 0.8**r, ranks scattered over the vocabulary so that the sampler
    has to sort. Sorted probabilities: 0.200, 0.160, 0.128, 0.102, 0.082, 0.066, 0.052, ..."""
    ranks = [(7 * i + 3) % VOCAB for i in range(VOCAB)]  # 7 is coprime with 50: a permutation
    return torch.tensor([r * math.log(0.8) for r in ranks], dtype=torch.float32)


def expected_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> dict[int, float]:
    """The distribution to sample from, straight from the definitions: softmax(logits / T);
    min-p keeps p >= min_p * max p; top-k keeps the k most likely of those; top-p keeps the
    smallest most-likely-first prefix whose mass, renormalized over what is left, reaches top_p."""
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(s - peak) for s in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept = sorted(
        (i for i in range(len(probs)) if probs[i] >= min_p * max(probs)), key=lambda i: -probs[i]
    )
    if top_k > 0:
        kept = kept[:top_k]
    mass = sum(probs[i] for i in kept)
    support: list[int] = []
    cumulative = 0.0
    for i in kept:
        support.append(i)
        cumulative += probs[i] / mass
        if top_p < 1.0 and cumulative >= top_p:
            # The cases below keep clear of the boundary, so float rounding cannot move it.
            assert abs(cumulative - top_p) > 1e-3
            break
    mass = sum(probs[i] for i in support)
    return {i: probs[i] / mass for i in support}


def draw(logits: torch.Tensor, params: SamplingParams, num_draws: int, seed: int) -> list[int]:
    """`num_draws` samples from one request's distribution, many rows per sampler call."""
    sampler = Sampler(seed=0)
    request = make_sequence(params, seed=seed)
    rows = 500
    tokens: list[int] = []
    while len(tokens) < num_draws:
        batch = logits.expand(rows, -1).contiguous()
        tokens.extend(s.token_id for s in sampler(batch, [request] * rows))
    return tokens[:num_draws]


SUPPORT_CASES = [
    # temperature, top_k, top_p, min_p, expected support size (a cross-check of the helper)
    pytest.param(1.0, 0, 1.0, 0.0, 50, id="unfiltered"),
    pytest.param(1.0, 5, 1.0, 0.0, 5, id="top_k=5"),
    pytest.param(1.0, 1, 1.0, 0.0, 1, id="top_k=1"),
    # cumulative 0.590 after 4 tokens, 0.672 after 5: keeping only "cumsum <= top_p" would give 4
    pytest.param(1.0, 0, 0.6, 0.0, 5, id="top_p=0.6"),
    # renormalized over the top 8 (mass 0.832): 0.587 after 3, 0.710 after 4; unrenormalized: 6
    pytest.param(1.0, 8, 0.7, 0.0, 4, id="top_k=8+top_p=0.7"),
    pytest.param(1.0, 0, 1e-6, 0.0, 1, id="tiny_top_p_keeps_argmax"),
    # 0.8**5 = 0.33 >= 0.3 > 0.8**6
    pytest.param(1.0, 0, 1.0, 0.3, 6, id="min_p=0.3"),
    pytest.param(1.0, 0, 1.0, 1.0, 1, id="min_p=1"),
    # renormalized over min-p's 6 tokens (mass 0.738): 0.661 after 3, 0.800 after 4; unrenormalized: 6
    pytest.param(1.0, 0, 0.75, 0.3, 4, id="min_p=0.3+top_p=0.75"),
    # T=0.5 squares the ratios (0.64**r): cumulative 0.893 after 5, 0.932 after 6; top-p before
    # temperature would keep 11
    pytest.param(0.5, 0, 0.9, 0.0, 6, id="T=0.5+top_p=0.9"),
    pytest.param(2.0, 3, 1.0, 0.0, 3, id="T=2+top_k=3"),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,support_size", SUPPORT_CASES)
def test_samples_stay_in_support_with_the_right_frequencies(
    temperature: float, top_k: int, top_p: float, min_p: float, support_size: int
) -> None:
    logits = geometric_logits()
    expected = expected_distribution(logits.tolist(), temperature, top_k, top_p, min_p)
    assert len(expected) == support_size
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    num_draws = 4000
    tokens = draw(logits, params, num_draws, seed=1234)

    outside = set(tokens) - set(expected)
    assert not outside, f"sampled outside the support: {sorted(outside)}"
    counts = Counter(tokens)
    # Every token with an expected count of 40 or more shows up (a support that is too small fails).
    assert {i for i, p in expected.items() if p * num_draws >= 40} <= set(counts)
    # Frequencies: the standard deviation is at most sqrt(0.25 / 4000) = 0.008.
    worst = max(abs(counts[i] / num_draws - p) for i, p in expected.items())
    assert worst < 0.03, f"frequency off by {worst:.3f}"


def test_draws_are_reproducible_for_a_seed_and_differ_across_seeds() -> None:
    logits = geometric_logits()
    params = SamplingParams(temperature=1.0)
    assert draw(logits, params, 200, seed=7) == draw(logits, params, 200, seed=7)
    assert draw(logits, params, 200, seed=7) != draw(logits, params, 200, seed=8)


# ----------------------------------------------------------------- penalties and bias


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    prompt = [1, 2, 3, 3, 9, 9, 9]
    output = [3, 5, 5, 5, 7, 40]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    row = logits.clone()
    apply_penalties(row, params, prompt, output)

    expected = logits.clone()
    for token, count in Counter(output).items():  # tokens 1, 2 and 9 (prompt only) untouched
        expected[token] -= count * 0.5 + 0.25
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


def test_negative_frequency_and_presence_penalties_raise_logits() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    row = logits.clone()
    apply_penalties(row, SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), [4], [6, 6])
    expected = logits.clone()
    expected[6] += 2 * 1.0 + 2.0
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 1.0, 0.0], dtype=torch.float32)
    prompt = [0, 1, 1]  # repeated tokens are penalized once, not per occurrence
    output = [2, 3, 3, 7]
    row = logits.clone()
    apply_penalties(row, SamplingParams(repetition_penalty=1.25), prompt, output)
    expected = torch.tensor([2.0 / 1.25, -2.0 * 1.25, 0.5 / 1.25, -0.5 * 1.25, 3.0, -3.0, 1.0, 0.0])
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e300])
def test_an_extreme_repetition_penalty_never_makes_nan(penalty: float) -> None:
    """Outside float32's range the penalty once overflowed logits to infinities, whose softmax
    is NaN: every draw then took the vocabulary's last token. Now a tiny penalty makes the seen
    tokens with positive logits the only likely ones, a huge one the seen tokens the least."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)).abs() + 0.1
    logits[7] = float("-inf")  # masked (a grammar): stays masked whatever the penalty
    seen = [5, 6, 7, 8]
    row = logits.clone()
    apply_penalties(row, SamplingParams(repetition_penalty=penalty), seen, [])
    assert not row.isnan().any() and row[7] == float("-inf")
    probs = torch.softmax(row, dim=-1)
    assert not probs.isnan().any()
    unseen = [t for t in range(VOCAB) if t not in seen]
    if penalty < 1:  # the seen tokens are the only ones drawn
        params = SamplingParams(temperature=1.0, repetition_penalty=penalty, max_tokens=50)
        seq = make_sequence(params, prompt=seen, seed=3)
        tokens = {Sampler(seed=0)(logits.clone()[None], [seq])[0].token_id for _ in range(20)}
        assert tokens <= {5, 6, 8}
    else:  # the seen tokens rank below every other
        assert row[[5, 6, 8]].max() < row[unseen].min()


def test_repetition_then_frequency_and_presence() -> None:
    """vLLM's order: the repetition penalty scales the logit, then the OpenAI penalties subtract."""
    logits = torch.tensor([2.0, -2.0, 1.0, 4.0], dtype=torch.float32)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    row = logits.clone()
    apply_penalties(row, params, prompt_ids=[2], output_ids=[0, 0, 1])
    expected = torch.tensor([2.0 / 2 - 2 * 1.0 - 0.5, -2.0 * 2 - 1.0 - 0.5, 1.0 / 2, 4.0])
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


def test_logit_bias_is_added() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    bias = {3: 5.0, 17: -100.0, 49: 0.5}
    row = logits.clone()
    apply_logit_bias(row, bias)
    expected = logits.clone()
    for token, value in bias.items():
        expected[token] += value
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)


def test_plain_greedy_rows_in_a_mixed_batch_take_the_first_maximum() -> None:
    """Plain greedy rows are reduced together; rows with a temperature or min_tokens beside them
    still go their own way, and ties go to the lowest token id, as argmax breaks them."""
    logits = torch.zeros(4, VOCAB)
    logits[0, [7, 30]] = 5.0  # a tie: token 7 wins
    logits[1, [3, 40]] = 5.0  # min_tokens not reached, EOS (3) masked: token 40
    logits[2, 9] = 50.0  # sampled at temperature 1: token 9 carries all the mass
    logits[3, 45] = float("nan")  # a NaN is the maximum, as for argmax
    eos_early = make_sequence(SamplingParams(temperature=0, min_tokens=2))
    eos_early.eos_token_id = 3
    seqs = [
        make_sequence(SamplingParams(temperature=0)),
        eos_early,
        make_sequence(SamplingParams(temperature=1.0), seed=0),
        make_sequence(SamplingParams(temperature=0)),
    ]
    tokens = [s.token_id for s in Sampler(seed=0)(logits.clone(), seqs)]
    assert tokens == [7, 40, 9, 45]
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())


def test_greedy_takes_the_argmax_after_bias_and_penalties_and_reports_raw_logprobs() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    top = logits.argmax(dim=-1).tolist()
    runner_up = logits.topk(2, dim=-1).indices[:, 1].tolist()
    cases = [
        # plain greedy
        (SamplingParams(temperature=0, logprobs=2), [], []),
        # the bias lifts a token well above the rest
        (SamplingParams(temperature=0, logit_bias={11: 50.0}, logprobs=2), [], []),
        # the argmax was generated three times: the penalties must push it below the runner-up
        (
            SamplingParams(
                temperature=0,
                frequency_penalty=2.0,
                presence_penalty=2.0,
                repetition_penalty=1.5,
                logit_bias={runner_up[2]: 0.1},
                logprobs=2,
            ),
            [top[2]],
            [top[2]] * 3,
        ),
    ]
    requests = [make_sequence(p, prompt=prompt or None, output=out) for p, prompt, out in cases]
    samples = Sampler(seed=0)(logits.clone(), requests)

    raw = torch.log_softmax(logits, dim=-1)
    for i, ((params, prompt, output), sample) in enumerate(zip(cases, samples)):
        adjusted = logits[i].clone()
        for token, value in (params.logit_bias or {}).items():
            adjusted[token] += value
        for token in set(prompt) | set(output):
            p = params.repetition_penalty
            adjusted[token] = adjusted[token] / p if adjusted[token] > 0 else adjusted[token] * p
        for token, count in Counter(output).items():
            adjusted[token] -= count * params.frequency_penalty + params.presence_penalty
        assert sample.token_id == int(adjusted.argmax())
        # Logprobs are the model's own distribution: before bias, penalties and temperature.
        assert sample.logprobs is not None
        assert next(iter(sample.logprobs)) == sample.token_id
        assert sample.logprobs[sample.token_id] == pytest.approx(
            float(raw[i, sample.token_id]), abs=1e-6
        )
        top2 = raw[i].topk(2)
        for token, value in zip(top2.indices.tolist(), top2.values.tolist()):
            assert sample.logprobs[token] == pytest.approx(value, abs=1e-6)
    assert samples[0].token_id == top[0]
    assert samples[1].token_id == 11
    assert samples[2].token_id != top[2]


# ----------------------------------------------------------------- validation


class HostWrites(TorchDispatchMode):
    """Records the two ways a host value is written into a device tensor one element at a time:
    `t[i] = x` (copy_ of a 0-dim tensor) and `t[ids] = x` (index_put_ of a 0-dim value), where the
    0-dim tensor is the Python number made a host tensor (it comes through `lift_fresh`; a value
    computed on the device comes from another op). On CUDA each is a blocking copy from host
    memory: a synchronization per sampled row."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.produced: list[torch.Tensor] = []  # every tensor an op returned, by identity

    def from_host(self, t: torch.Tensor) -> bool:
        return t.dim() == 0 and all(t is not p for p in self.produced)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and self.from_host(args[1]):
            self.writes.append("copy_ of a host scalar")
        if func is torch.ops.aten.index_put_.default and self.from_host(args[2]):
            self.writes.append("index_put_ of a host scalar")
        out = func(*args, **kwargs)
        if func is not torch.ops.aten.lift_fresh.default:
            self.produced += [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_no_row_writes_a_host_scalar_into_the_logits() -> None:
    """The CPU side of tests/gpu/test_gpu.py's one-synchronization check, which found these
    writes on an H100: every filter, penalty, bias and min_tokens path, with no scalar written
    element-wise (slices are filled, indices go through index_fill_)."""
    seqs = []
    for i in range(8):
        params = SamplingParams(
            temperature=0.8 if i % 4 else 0.0,
            top_p=0.9 if i % 2 else 1.0,
            top_k=5 if i % 3 == 1 else -1,
            min_p=0.05 if i == 5 else 0.0,
            presence_penalty=0.5 if i == 6 else 0.0,
            repetition_penalty=1.2 if i == 7 else 1.0,
            logit_bias={5: 3.0} if i == 3 else None,
            min_tokens=4 if i == 2 else 0,
            stop_token_ids=[9] if i == 2 else None,
            seed=i,
        )
        seqs.append(make_sequence(params, output=[7], seed=i))
    logits = geometric_logits().repeat(8, 1)
    with HostWrites() as mode:
        samples = Sampler(0)(logits, seqs)
    assert len(samples) == 8
    assert mode.writes == []


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_boundary_sampling_params_are_valid() -> None:
    SamplingParams(
        n=1,
        temperature=0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        max_tokens=1,
        seed=-(2**63),
        logprobs=0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
    )
    assert SamplingParams(top_k=-1).top_k == 0  # -1 means disabled, like 0
    assert SamplingParams(max_tokens=None).max_tokens is None


# ----------------------------------------------------------------- seeds through the engine


@pytest.fixture(scope="module")
def llm(qwen2_dir: Path) -> LLM:
    return LLM(
        str(qwen2_dir),
        max_model_len=256,
        num_kv_blocks=128,
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=16,
    )


def test_engine_validation_names_the_parameter(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    prompt = [1, 2, 3]
    cases = [
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        (SamplingParams(n=17), "n"),
    ]
    for params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.engine.check(prompt, params)
        assert info.value.param == param


def test_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(llm: LLM) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because"
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    assert len(alone) == 16

    # Others of different prompt lengths, seeds, sample counts and lengths, before and after it,
    # so that the batch (and the chunking of the prompts) changes from step to step.
    others = [
        ("Hi", SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)),
        (
            "A much longer prompt " * 6,
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True),
        ),
        (
            "Seeded neighbour",
            SamplingParams(temperature=1.0, seed=99, n=2, max_tokens=9, ignore_eos=True),
        ),
        (
            "Same seed, other prompt",
            SamplingParams(temperature=1.0, seed=1234, max_tokens=3, ignore_eos=True),
        ),
        ("Greedy one", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ]
    prompts = [p for p, _ in others[:3]] + [prompt] + [p for p, _ in others[3:]]
    params = [s for _, s in others[:3]] + [seeded] + [s for _, s in others[3:]]
    batched = llm.generate(prompts, params)
    assert batched[3].outputs[0].token_ids == alone
    # The same prompt twice in one batch, with the same seed: the same tokens again.
    twice = llm.generate([prompt, "Hi", prompt], [seeded, others[0][1], seeded])
    assert twice[0].outputs[0].token_ids == alone
    assert twice[2].outputs[0].token_ids == alone

    # The n=2 neighbour is reproducible too, alone, and its two samples differ.
    neighbour = llm.generate([others[2][0]], others[2][1])[0]
    assert [o.token_ids for o in neighbour.outputs] == [o.token_ids for o in batched[2].outputs]
    assert neighbour.outputs[0].token_ids != neighbour.outputs[1].token_ids

    # Other seeds give other tokens (run together: seeded requests do not depend on the batch).
    others_seeded = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2, 3)
    ]
    different = [out.outputs[0].token_ids for out in llm.generate([prompt] * 3, others_seeded)]
    assert any(tokens != alone for tokens in different)


def test_logit_bias_keys_from_json_become_token_ids() -> None:
    """OpenAI clients send logit_bias as a JSON object: string keys must work, garbage must not
    reach the sampler."""
    assert SamplingParams(logit_bias={"5": 2, 7: -1.5}).logit_bias == {5: 2.0, 7: -1.5}
    for bad, param in (
        ({"x": 1.0}, "logit_bias"),
        ({3: 101.0}, "logit_bias"),
        ({3: -100.5}, "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.param == param
