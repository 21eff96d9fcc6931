"""Merging a request's outputs that queued up while its reader was busy.

A stream whose reader falls behind (a slow client, a busy event loop) finds several outputs of
its request waiting. Handing them over as one output costs the server one chunk, one JSON body
and one socket write instead of one per token, and loses nothing: an output carries the whole
state so far (text, token ids, logprobs) plus what is new since the previous one, so the merge
is the later output with the deltas of both.
"""

from __future__ import annotations

from engine.outputs import RequestOutput


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput | None:
    """`later` with `earlier`'s deltas prepended, or None when the two do not merge: a failed
    or finished `earlier`, or one with a sample `later` lacks (a beam search's empty first
    output is followed by the finished beams, which carry their whole text as the delta)."""
    if earlier.finished or earlier.error is not None or earlier.request_id != later.request_id:
        return None
    before = {c.index: c for c in earlier.outputs}
    if not before.keys() <= {c.index for c in later.outputs}:
        return None
    for c in later.outputs:
        old = before.get(c.index)
        if old is not None:
            c.text_delta = old.text_delta + c.text_delta
            c.token_ids_delta = old.token_ids_delta + c.token_ids_delta
    return later
