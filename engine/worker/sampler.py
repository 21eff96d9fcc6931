"""Turn logits into tokens: grammar masks, logit bias and penalties, then greedy or filtered
random sampling.

Logprobs are those of the model's raw distribution (log_softmax of the logits before grammar
masks, bias, penalties and temperature), as OpenAI and vLLM report them.

Every row's token is computed where the logits are, and the step's tokens come to the host in one
transfer: on a GPU, a row copied to the host to be sampled there would cost a synchronization and
a whole vocabulary (~600 KB) per sequence per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.scheduler_output import Sample
from engine.core.sequence import Sequence
from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.structured import apply_grammar_masks


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied without waiting for the device. On CUDA a copy from pageable
    memory synchronizes with the whole step queued before it; from page-locked memory (torch's
    caching host allocator, which keeps the block until the copy is done) it does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI: the bias is added to the logit of each listed token before sampling."""
    ids = to_device(torch.tensor(list(bias.keys()), dtype=torch.long), logits.device)
    vals = to_device(torch.tensor(list(bias.values()), dtype=logits.dtype), logits.device)
    logits.index_add_(0, ids, vals)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> None:
    """In place on one row. Repetition (over prompt and output tokens): a positive logit is
    divided by the penalty, a negative one multiplied. Frequency and presence (OpenAI, over the
    generated tokens): logit -= count * frequency_penalty + (count > 0) * presence_penalty."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = to_device(
            torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long), device
        )
        if seen.numel():
            vals = logits[seen]
            p = params.repetition_penalty
            # A penalty far from 1 (below float32's range, 1e-300 say) would overflow a logit to
            # an infinity, and softmax over infinities is NaN: the penalized logit is kept at
            # the dtype's largest magnitude instead. A masked logit (-inf) stays masked.
            big = torch.finfo(logits.dtype).max
            penalized = torch.where(vals > 0, vals / p, vals * p).clamp(-big, big)
            logits[seen] = torch.where(vals.isfinite(), penalized, vals)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        # scatter_add, not bincount: bincount on CUDA reads the largest id back to size its output.
        # Output ids were sampled from rows of this width, so each one has its place.
        ids = to_device(torch.tensor(output_ids, dtype=torch.long), device)
        counts = torch.zeros(logits.shape[0], dtype=logits.dtype, device=device)
        counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= (
            counts * params.frequency_penalty
            + (counts > 0).to(logits.dtype) * params.presence_penalty
        )


def stop_ids(seq: Sequence, vocab_size: int) -> list[int]:
    """The token ids that would end this sequence: its stop token ids and, unless ignored, EOS."""
    ids = list(seq.params.stop_token_ids)
    if seq.eos_token_id is not None and not seq.params.ignore_eos:
        ids.append(seq.eos_token_id)
    return [i for i in ids if 0 <= i < vocab_size]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (-inf) every token outside the support of min-p, then top-k, then top-p (on the
    distribution renormalized after top-k). The most likely token always survives."""
    out = logits.clone()
    if min_p > 0:
        probs = torch.softmax(out, dim=-1)
        out.masked_fill_(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 or top_p < 1:
        sorted_logits, order = out.sort(descending=True)
        if 0 < top_k < sorted_logits.shape[-1]:
            sorted_logits[top_k:] = float("-inf")
        if top_p < 1:
            probs = torch.softmax(sorted_logits, dim=-1)
            before = probs.cumsum(-1) - probs  # mass strictly above each token
            drop = before >= top_p
            drop[:1] = False  # a slice: an integer index would copy the value over and wait
            sorted_logits.masked_fill_(drop, float("-inf"))
        out = torch.empty_like(out).scatter_(0, order, sorted_logits)
    return out


def position_logprobs(logprobs_row: torch.Tensor, token_id: int, top_n: int) -> PositionLogprobs:
    """The chosen token's logprob first, then the top `top_n` alternatives in rank order."""
    result = {token_id: float(logprobs_row[token_id])}
    if top_n:
        values, ids = logprobs_row.topk(top_n)
        for i, v in zip(ids.tolist(), values.tolist()):
            result.setdefault(i, v)
    return result


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per draw (an order of magnitude cheaper than
    multinomial over a large vocabulary). `right=True` skips zero-probability tokens, whose
    interval of the CDF is empty; scaling u by the total keeps float rounding of the CDF from
    running past the last token (the clamp covers u rounding up to the total itself).

    The uniform number comes from the request's own CPU generator (a seed gives the same draws on
    any device and in any batch) and goes to the device as one scalar; the token stays there, a
    one-element tensor."""
    cdf = probs.double().cumsum(0)
    u = to_device(torch.rand(1, generator=generator, dtype=torch.float64), probs.device) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.numel() - 1)


def before_min_tokens(seq: Sequence) -> bool:
    return seq.num_output_tokens < seq.params.min_tokens


def takes_argmax(seq: Sequence) -> bool:
    """Whether the row's token is its argmax as it stands: greedy, nothing to add or mask."""
    params = seq.params
    return (
        params.greedy
        and not params.logit_bias
        and not params.uses_penalties
        and not before_min_tokens(seq)
    )


class Sampler:
    def __init__(self, seed: int) -> None:
        # Unseeded sequences share this generator; seeded ones carry their own.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        """One token per row; row i belongs to seqs[i]. Rows under a grammar are masked in
        place (`logits` is the step's own stack of rows)."""
        return [s for s in self.sample_or_fail(logits, seqs, None) if s is not None]

    def sample_or_fail(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        on_error: Callable[[int, Exception], None] | None,
    ) -> list[Sample | None]:
        """As `__call__`, except that with `on_error`, a row whose own sampling raises is
        reported there and gets None, while the other rows are sampled as they would have been
        (each seeded row's draws unchanged); without it, the row's exception is raised."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        apply_grammar_masks(logits, [seq.grammar for seq in seqs])
        # Rows that only take the argmax take it together: one reduction for all of them (max's
        # indices: the first maximum, as argmax; 16 rows of 49,152: 0.17 ms, one argmax a row 1 ms).
        # The other rows overwrite theirs on the device; then one transfer brings all to the host.
        tokens = logits.max(dim=-1).indices
        failed: set[int] = set()

        def fail(i: int, exc: Exception) -> None:
            if on_error is None:
                raise exc
            on_error(i, exc)
            failed.add(i)

        # Past this point every piece of work is one row's, and a failure is that row's alone:
        # work shared by the rows, which no row's draw has yet followed, is all above.
        for i, seq in enumerate(seqs):
            try:
                if not takes_argmax(seq):
                    tokens[i : i + 1] = self._sample_row(logits[i], seq)
            except Exception as exc:  # noqa: BLE001 - handed to on_error, or raised
                fail(i, exc)
        samples: list[Sample | None] = []
        for i, token in enumerate(tokens.tolist()):
            seq = seqs[i]
            lp = None
            if i not in failed and raw_logprobs is not None and seq.params.logprobs is not None:
                try:
                    lp = position_logprobs(raw_logprobs[i], token, seq.params.logprobs)
                except Exception as exc:  # noqa: BLE001 - handed to on_error, or raised
                    fail(i, exc)
            samples.append(None if i in failed else Sample(token, lp))
        return samples

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The row's token, a one-element tensor on the row's device."""
        params = seq.params
        too_early = before_min_tokens(seq)
        if params.logit_bias or params.uses_penalties or too_early:
            row = row.clone()
            if params.logit_bias:
                apply_logit_bias(row, params.logit_bias)
            if params.uses_penalties:
                apply_penalties(row, params, seq.prompt_token_ids, seq.output_token_ids)
            if too_early:  # no token that would end the output before min_tokens
                ids = to_device(
                    torch.tensor(stop_ids(seq, row.shape[0]), dtype=torch.long), row.device
                )
                kept = row[ids]
                row.index_fill_(0, ids, float("-inf"))  # `row[ids] = x` waits for the copy of x
                # A finished grammar allows only its end: the grammar wins (decided on the device).
                row[ids] = torch.where(row.isfinite().any(), row[ids], kept)
        if params.greedy:
            return row.argmax().reshape(1)
        row = filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p)
        return draw(torch.softmax(row, dim=-1), seq.generator or self.generator)
