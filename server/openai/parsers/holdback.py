"""Holding back text that may be the beginning of a marker split across deltas."""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (0 if none).

    A streaming parser keeps that many characters back: the next delta decides whether they
    start the marker or are plain text. Any marker occurrence not wholly inside `text` begins in
    that end, so everything before it can be released.
    """
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
