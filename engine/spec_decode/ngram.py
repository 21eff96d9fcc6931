"""Prompt lookup: guess that the text goes on as it went on after the last earlier place where
its latest tokens appeared, in the prompt or the output so far. Costs no model: it pays off
where outputs copy their input (summaries, code edits, quoting)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.sequence import Sequence


def lookup(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` between `min_n` and `max_n` long; none when no such suffix occurred before."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start early enough to have a token after them, the suffix excluded.
        windows = sliding_window_view(tokens[: length - 1], n)
        found = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if found.size:
            start = int(found[-1]) + n
            return tokens[start : start + num_drafts].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        return [
            lookup(np.asarray(seq.all_token_ids, dtype=np.int64), self.min_n, self.max_n, k)
            for seq, k in zip(seqs, max_drafts, strict=True)
        ]

    def close(self) -> None:
        pass
