"""One sequence's place in its grammar, and the per-step token mask over a batch of rows."""

from __future__ import annotations

from typing import Any

import torch

from engine.structured.params import StructuredOutputsParams


class GrammarState:
    """Advances with each token the sequence accepts. Until `starts_after` appears (the end of a
    reasoning block) the output is free and the grammar waits."""

    def __init__(self, compiled: Any, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.waiting_for = params.starts_after

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token_id: int) -> bool:
        """Take the sampled token; True when the grammar is done (it took its stop token), so
        that the sequence ends there."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return False
        if not self.matcher.accept_token(token_id):
            # Only a token outside the mask gets here (min_tokens never unmasks one): stop
            # rather than continue outside the grammar.
            return True
        return bool(self.matcher.is_terminated())


def apply_grammar_masks(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """In place: every row whose grammar is active gets -inf outside the tokens its grammar
    allows next. One bitmask for the batch (32 tokens a word), filled per row by xgrammar,
    applied in one op."""
    rows = [i for i, s in enumerate(states) if s is not None and s.active]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        state = states[i]
        assert state is not None
        state.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
