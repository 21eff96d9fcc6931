"""The token-level reasons a sequence ends. Stop strings are text, checked where the text is
made (engine/processing/output_processor.py)."""

from __future__ import annotations

from engine.core.sequence import Sequence


def check_stop(seq: Sequence, token_id: int, max_model_len: int) -> None:
    """Set `finish_reason` (and `stop_reason`) if `token_id`, just appended, ends the sequence."""
    params = seq.params
    if token_id in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token_id
    elif token_id == seq.eos_token_id and not params.ignore_eos:
        seq.finish_reason = "stop"
    elif (
        params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
    ) or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
    if seq.grammar is not None and seq.grammar.accept(token_id):
        seq.finish_reason = seq.finish_reason or "stop"  # the grammar is complete
