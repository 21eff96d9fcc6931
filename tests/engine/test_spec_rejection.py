"""The rejection sampler emits tokens distributed exactly as the target's distributions, for
drafts with full distributions and for one-hot drafts; and the checks have the power to see the
plausible wrong versions.

Each distribution check is a chi-square goodness-of-fit test over many seeded draws: it fails
when the p-value falls below 1e-4. Fixed seeds make every outcome the same on every run.
"""

from __future__ import annotations

import torch

from engine.spec_decode.rejection import RejectionResult, rejection_sample, rejection_sample_batch
from engine.worker.sampler import draw

DRAWS = 40_000
SIGNIFICANCE = 1e-4

# Target p and draft q over a vocabulary of 6 for k = 2 drafted positions and the bonus one.
# The draft puts much of its mass where the target puts little, so that acceptance matters.
P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.10, 0.45, 0.20, 0.15, 0.05],
        [0.10, 0.30, 0.05, 0.25, 0.10, 0.20],
    ],
    dtype=torch.float64,
)
Q = torch.tensor(
    [
        [0.05, 0.10, 0.10, 0.15, 0.30, 0.30],
        [0.30, 0.05, 0.20, 0.05, 0.10, 0.30],
    ],
    dtype=torch.float64,
)
K = Q.shape[0]


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of the observed tokens against the expected distribution; the
    p-value is the chi-square survival function, the regularized upper incomplete gamma."""
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs * tokens.numel()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = expected_probs.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
    return stat, p_value


def draft_from_q(seed: int) -> torch.Tensor:
    """DRAWS drafts [DRAWS, K], position i sampled from Q[i] as a draft model would."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(Q[i], DRAWS, True, generator=g) for i in range(K)], 1)


def run_batch(draft_probs: torch.Tensor | None, seed: int = 0) -> RejectionResult:
    g = torch.Generator().manual_seed(seed)
    qs = None if draft_probs is None else draft_probs.expand(DRAWS, -1, -1)
    return rejection_sample_batch(P.expand(DRAWS, -1, -1), qs, draft_from_q(seed + 1), g)


def assert_fits(tokens: torch.Tensor, expected_probs: torch.Tensor, what: str) -> None:
    stat, p_value = chi_square(tokens, expected_probs)
    print(f"{what}: n={tokens.numel()} chi2={stat:.2f} p={p_value:.3g}")
    assert p_value >= SIGNIFICANCE, (what, stat, p_value)


def test_emitted_tokens_follow_the_target_with_a_full_draft_distribution() -> None:
    result = run_batch(Q)
    assert_fits(result.tokens[:, 0], P[0], "first token")
    first_accepted = result.num_emitted >= 2
    assert_fits(result.tokens[first_accepted, 1], P[1], "second token | first accepted")
    all_accepted = result.num_emitted == K + 1
    assert_fits(result.tokens[all_accepted, K], P[K], "bonus token | all accepted")


def test_emitted_tokens_follow_the_target_with_one_hot_drafts() -> None:
    # However the drafts were chosen (here sampled from Q), one-hot verification is exact; only
    # its acceptance is lower.
    result = run_batch(None)
    assert_fits(result.tokens[:, 0], P[0], "one-hot first token")
    first_accepted = result.num_emitted >= 2
    assert_fits(result.tokens[first_accepted, 1], P[1], "one-hot second token | first accepted")
    all_accepted = result.num_emitted == K + 1
    assert_fits(result.tokens[all_accepted, K], P[K], "one-hot bonus token | all accepted")


def test_acceptance_rate_is_the_overlap_of_p_and_q() -> None:
    for draft_probs in (Q, None):
        result = run_batch(draft_probs, seed=7)
        drafts = draft_from_q(8)
        if draft_probs is None:
            # One-hot q = delta_d overlaps p by p(d); here d ~ Q[0], so the mean is sum p * Q[0].
            expected = float((P[0] * Q[0]).sum())
        else:
            expected = float(torch.minimum(P[0], Q[0]).sum())
        rate = float((result.num_emitted >= 2).double().mean())
        tolerance = 5 * (expected * (1 - expected) / DRAWS) ** 0.5
        print(
            f"draft_probs={'q' if draft_probs is not None else 'one-hot'}: "
            f"acceptance {rate:.4f}, expected {expected:.4f}"
        )
        assert abs(rate - expected) < tolerance, (rate, expected)
        accepted_rows = result.num_emitted >= 2
        assert torch.equal(result.tokens[accepted_rows, 0], drafts[accepted_rows, 0])


def first_tokens(accept_prob: torch.Tensor, recover: torch.Tensor, seed: int) -> torch.Tensor:
    """First emitted tokens of a verification rule for position 0: draft d ~ Q[0] is accepted
    with probability accept_prob[d], otherwise a token is drawn from `recover`."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q[0], DRAWS, True, generator=g)
    accepted = torch.rand(DRAWS, generator=g, dtype=torch.float64) < accept_prob[drafts]
    recovered = torch.multinomial(recover, DRAWS, True, generator=g)
    return torch.where(accepted, drafts, recovered)


def test_the_fit_check_detects_plausible_wrong_samplers() -> None:
    ratio = (P[0] / Q[0]).clamp(max=1)
    residual = (P[0] - Q[0]).clamp(min=0)
    residual /= residual.sum()
    # The rule written out here passes, so the failures below come from the mistakes alone.
    assert_fits(first_tokens(ratio, residual, 0), P[0], "the rule, written out")

    # Wrong 1: accept when u < p(d), forgetting q(d); the residual is the right one.
    stat, p_value = chi_square(first_tokens(P[0], residual, 0), P[0])
    print(f"accept if u < p(d): chi2={stat:.1f} p={p_value:.3g}")
    assert p_value < SIGNIFICANCE

    # Wrong 2: the right accept test, but a rejection emits from p instead of the residual, which
    # counts the overlap min(p, q) twice.
    stat, p_value = chi_square(first_tokens(ratio, P[0], 0), P[0])
    print(f"recovery from p: chi2={stat:.1f} p={p_value:.3g}")
    assert p_value < SIGNIFICANCE


def test_output_shape_and_draft_prefix() -> None:
    result = run_batch(Q, seed=3)
    drafts = draft_from_q(4)
    assert ((result.num_emitted >= 1) & (result.num_emitted <= K + 1)).all()
    for row in range(200):
        n = int(result.num_emitted[row])
        emitted = result.tokens[row]
        assert torch.equal(emitted[: n - 1], drafts[row, : n - 1])  # accepted drafts, in order
        assert 0 <= int(emitted[n - 1]) < P.shape[1]
        assert (emitted[n:] == -1).all()


def test_a_draft_token_the_target_forbids_is_never_emitted() -> None:
    # A grammar mask zeroes token 5 at position 0; the draft proposes it with high probability.
    p = P.clone()
    p[0, 5] = 0
    p[0] /= p[0].sum()
    g = torch.Generator().manual_seed(0)
    drafts = torch.full((DRAWS, K), 5)
    for draft_probs in (Q.expand(DRAWS, -1, -1), None):
        result = rejection_sample_batch(p.expand(DRAWS, -1, -1), draft_probs, drafts, g)
        assert (result.num_emitted == 1).all()
        assert (result.tokens[:, 0] != 5).all()


def test_a_seed_repeats_its_tokens() -> None:
    drafts = torch.tensor([4, 0])

    def sample(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [rejection_sample(P, Q, drafts, g) for _ in range(50)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    # One sequence is a batch of one: the same uniforms give the same tokens.
    g = torch.Generator().manual_seed(5)
    batch = rejection_sample_batch(P[None], Q[None], drafts[None], g)
    single = rejection_sample(P, Q, drafts, torch.Generator().manual_seed(5))
    assert single == batch.tokens[0, : int(batch.num_emitted[0])].tolist()


def test_no_drafts_draws_the_bonus_token_from_the_target() -> None:
    g = torch.Generator().manual_seed(0)
    result = rejection_sample_batch(
        P[:1].expand(DRAWS, -1, -1), Q[:0].expand(DRAWS, -1, -1), torch.empty(DRAWS, 0), g
    )
    assert (result.num_emitted == 1).all()
    assert_fits(result.tokens[:, 0], P[0], "bonus token, k = 0")


def test_match_verification_with_the_sampler_draw_emits_the_target_distribution() -> None:
    # The engine's verification of a one-hot draft d: sample t ~ p with the ordinary sampler's
    # draw, accept d when t == d, and emit t either way. Draft d = 4, a token p rarely gives.
    g = torch.Generator().manual_seed(0)
    draft, n = 4, 20_000
    sampled = torch.stack([draw(P[0], g) for _ in range(n)]).squeeze(-1)
    assert_fits(sampled, P[0], "match verification first token")
    rate = float((sampled == draft).double().mean())
    tolerance = 5 * (float(P[0, draft]) * (1 - float(P[0, draft])) / n) ** 0.5
    assert abs(rate - float(P[0, draft])) < tolerance, rate
