"""The engine's verification of drafts keeps the target's distribution when sampling: over many
sequences verified in one step, the first emitted token follows p at position 0, the second
(given the first draft was accepted) p at position 1, and the bonus token (given every draft was
accepted) p at position 2; each draft is accepted with probability p(draft), as rejection
sampling of a one-hot draft accepts it. And the fit check has the power to see the plausible
wrong rule.

Each check is a chi-square goodness-of-fit test that fails below a p-value of 1e-4; the
sampler's seed is fixed, so every outcome is the same on every run.
"""

from __future__ import annotations

import torch

from config import SpeculativeConfig
from engine.core.request_failures import RequestFailures
from engine.core.scheduler_output import Sample, ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Speculator
from engine.worker.sampler import Sampler

SIGNIFICANCE = 1e-4
TRIALS = 12_000
# The target's distributions at the two drafted positions and the bonus one, over 6 tokens.
P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.10, 0.45, 0.20, 0.15, 0.05],
        [0.10, 0.30, 0.05, 0.25, 0.10, 0.20],
    ],
    dtype=torch.float64,
)
DRAFTS = [0, 2]  # likely drafts, so that many trials reach the later positions


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of the observed tokens against the expected distribution; the
    p-value is the chi-square survival function, the regularized upper incomplete gamma."""
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs * tokens.numel()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = expected_probs.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    return stat, p_value


def assert_fits(tokens: list[int], expected: torch.Tensor, what: str) -> None:
    stat, p_value = chi_square(torch.tensor(tokens), expected)
    print(f"{what}: n={len(tokens)} chi2={stat:.2f} p={p_value:.3g}")
    assert p_value >= SIGNIFICANCE, (what, stat, p_value)


def verify_trials(drafts: list[int], trials: int) -> tuple[list[list[int]], Speculator]:
    """`trials` sequences, each with the same drafts, verified in one step on logits whose
    softmax is P: every sequence's emitted tokens. The first sample is the engine's (the row
    after the sequence's own token); the speculator samples the rest."""
    params = SamplingParams(temperature=1.0, max_tokens=100)
    seqs = [
        Sequence(str(i), str(i), 0, [5], params, 0.0, status=SequenceStatus.RUNNING)
        for i in range(trials)
    ]
    k = len(drafts)
    out = SchedulerOutput(
        [ScheduledSequence(seq, 1 + k, [], 0, [seq], draft_token_ids=drafts) for seq in seqs]
    )
    rows = [(i * (k + 1), k + 1) for i in range(trials)]
    logits = P[: k + 1].log().float().repeat(trials, 1)
    sampler = Sampler(seed=0)

    def take(seq: Sequence, sample: Sample) -> None:
        seq.append_token(sample.token_id)

    failures = RequestFailures()
    first = sampler(logits[[first for first, _ in rows]].clone(), seqs)
    taken = {id(seq): [sample] for seq, sample in zip(seqs, first)}
    for seq, sample in zip(seqs, first):
        take(seq, sample)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    speculator = Speculator(config, NgramProposer(2, 5), max_model_len=1000)
    speculator.verify(out, rows, logits, taken, sampler, take, failures)
    assert not failures.errors
    return [seq.output_token_ids for seq in seqs], speculator


def test_emitted_tokens_follow_the_target_distribution() -> None:
    emitted, speculator = verify_trials(DRAFTS, TRIALS)
    assert_fits([t[0] for t in emitted], P[0], "first token")
    after_first = [t for t in emitted if t[0] == DRAFTS[0]]
    assert_fits([t[1] for t in after_first], P[1], "second token | first draft accepted")
    after_all = [t for t in after_first if t[1] == DRAFTS[1]]
    assert_fits([t[2] for t in after_all], P[2], "bonus token | every draft accepted")
    # A sequence emits its accepted drafts and one token more.
    for tokens in emitted:
        accepted = 0
        while accepted < len(DRAFTS) and tokens[accepted] == DRAFTS[accepted]:
            accepted += 1
        assert len(tokens) == accepted + 1
    # Each draft is accepted with probability p(draft): rejection sampling of a one-hot draft.
    for position, reached, accepted in (
        (0, TRIALS, len(after_first)),
        (1, len(after_first), len(after_all)),
    ):
        expected = float(P[position, DRAFTS[position]])
        rate = accepted / reached
        assert abs(rate - expected) < 5 * (expected * (1 - expected) / reached) ** 0.5
    # The counts as vLLM keeps them.
    stats = speculator.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens) == (TRIALS, TRIALS * len(DRAFTS))
    assert stats.accepted_per_position == [len(after_first), len(after_all)]
    assert stats.num_accepted_tokens == len(after_first) + len(after_all)


def test_an_unlikely_draft_is_accepted_as_rarely_as_the_target_says() -> None:
    emitted, _ = verify_trials([5, 1], TRIALS)  # p(5) = 0.04 at position 0
    assert_fits([t[0] for t in emitted], P[0], "first token, unlikely draft")
    rate = sum(t[0] == 5 for t in emitted) / TRIALS
    assert abs(rate - 0.04) < 5 * (0.04 * 0.96 / TRIALS) ** 0.5


def test_the_fit_check_sees_a_wrong_rule() -> None:
    """A plausible wrong verification: accept the draft with probability p(d), but on a
    rejection emit a fresh sample of p (which may be the draft again). The draft is then
    emitted with probability p(d) + (1 - p(d)) p(d): the same check fails it."""
    g = torch.Generator().manual_seed(0)
    draft = DRAFTS[0]
    accepted = torch.rand(TRIALS, generator=g, dtype=torch.float64) < P[0, draft]
    fresh = torch.multinomial(P[0], TRIALS, replacement=True, generator=g)
    wrong = torch.where(accepted, torch.tensor(draft), fresh)
    stat, p_value = chi_square(wrong, P[0])
    print(f"wrong rule: chi2={stat:.1f} p={p_value:.3g}")
    assert p_value < SIGNIFICANCE
