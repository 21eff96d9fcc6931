"""Verify a draft against the target model so that the emitted tokens are distributed exactly as
the target alone would sample them (speculative sampling: Leviathan et al. 2023, Chen et al.
2023).

At each drafted position i, with the target's distribution p_i (temperature, filters, penalties
and grammar masks already applied) and the draft's q_i, the draft token d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)). The first rejected position emits a token drawn from the
residual normalize(max(p_i - q_i, 0)) and ends the draft; when all k drafts are accepted, a bonus
token is drawn from p_k. A draft without distributions (n-gram lookup, a greedy draft) is one-hot:
d_i is accepted with probability p_i(d_i) and the residual is p_i without d_i.

All randomness comes from the CPU generator passed in, so a seed repeats on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RejectionResult:
    """`tokens[b, :num_emitted[b]]` are row b's accepted drafts then its recovered or bonus
    token; the rest of the row is -1."""

    tokens: torch.Tensor  # [B, k + 1], int64
    num_emitted: torch.Tensor  # [B], int64, from 1 to k + 1


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    """One sequence: target_probs [k + 1, V], draft_probs [k, V] or None (one-hot drafts),
    draft_ids [k]. Returns the accepted draft tokens then one recovered or bonus token."""
    result = rejection_sample_batch(
        target_probs[None],
        None if draft_probs is None else draft_probs[None],
        draft_ids[None],
        generator,
    )
    return result.tokens[0, : int(result.num_emitted[0])].tolist()


def rejection_sample_batch(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    generator: torch.Generator,
) -> RejectionResult:
    """B sequences with k drafts each: target_probs [B, k + 1, V], draft_probs [B, k, V] or None,
    draft_ids [B, k]. Draws B * k uniforms for the accept tests, then B for the emitted tokens."""
    batch, k = draft_ids.shape
    device = target_probs.device
    draft_ids = draft_ids.to(device=device, dtype=torch.long)
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)

    # u < p/q written as u * q < p: no division, and a token the draft gave no mass (q = 0,
    # min(1, p/0) = 1) is accepted exactly when the target gives it some.
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64).to(device)
    accepted = u * q_draft.double() < p_draft.double()
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # the leading run of acceptances

    rows = torch.arange(batch, device=device)
    emit_dist = target_probs[rows, num_accepted].double()  # p at the first rejection, or p_k
    rejected = num_accepted < k
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(emit_dist)
            q_at[rows, draft_ids[rows, at]] = 1.0
        else:
            q_at = draft_probs[rows, at].double()
        residual = (emit_dist - q_at).clamp_(min=0)
        # A rejection leaves residual mass unless p and q differ only by float rounding; then p
        # itself is the closest thing to the residual.
        usable = rejected & (residual.sum(-1) > 0)
        emit_dist = torch.where(usable[:, None], residual, emit_dist)

    emitted = _inverse_cdf(emit_dist, torch.rand(batch, generator=generator, dtype=torch.float64))
    positions = torch.arange(k + 1, device=device)
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(positions[:k] < num_accepted[:, None], draft_ids, -1)
    tokens[rows, num_accepted] = emitted
    return RejectionResult(tokens=tokens, num_emitted=num_accepted + 1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalized float64 weights [B, V] from uniforms u [B] (CPU):
    `right=True` skips zero-weight tokens, and scaling u by the row's total avoids normalizing."""
    cdf = weights.cumsum(-1)
    target = u.to(weights.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
