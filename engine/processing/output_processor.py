"""After each step: detokenize the new tokens, look for stop strings, build the outputs."""

from __future__ import annotations

from engine.core.sequence import Sequence
from engine.outputs import CompletionOutput, RequestOutput
from engine.processing.request import Request, SequenceText


def update_text(
    seq: Sequence, text: SequenceText, token_id: int, num_output_tokens: int | None = None
) -> None:
    """Detokenize the new token (unless it ended the sequence as a stop token) and look for
    stop strings, including ones that span several tokens. `num_output_tokens`: the tokens
    generated up to this one, when the sequence has taken more since (speculative decoding)."""
    params = seq.params
    generated = seq.num_output_tokens if num_output_tokens is None else num_output_tokens
    stopped_by_token = seq.finish_reason == "stop"
    checked = len(text.text)  # text before this token was already searched
    if not stopped_by_token:
        text.text += text.detokenizer.add(token_id)
    if seq.finish_reason is not None:
        text.text += (
            text.detokenizer.flush()
        )  # an incomplete character held back, as decode shows it
    if not params.stop_strings or stopped_by_token or generated < params.min_tokens:
        return
    # Only the new text, plus enough before it to catch a stop string spanning the boundary.
    longest = max(len(s) for s in params.stop_strings)
    window_start = max(0, checked - longest + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop_strings:
        idx = text.text.find(stop, window_start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is not None:
        idx, stop = best
        text.text = (
            text.text[: idx + len(stop)] if params.include_stop_str_in_output else text.text[:idx]
        )
        seq.finish_reason, seq.stop_reason = "stop", stop


def update_texts(seq: Sequence, text: SequenceText, token_ids: list[int]) -> int:
    """`update_text` for each of the tokens the sequence took in one step (its last ones; more
    than one under speculative decoding); a stop string found after one of them drops the
    tokens after it. How many it kept."""
    first = seq.num_output_tokens - len(token_ids)  # the index of the step's first token
    for i, token_id in enumerate(token_ids[:-1]):
        # The sequence went on past this token: whatever ended it came later.
        reason, stop = seq.finish_reason, seq.stop_reason
        seq.finish_reason = seq.stop_reason = None
        update_text(seq, text, token_id, first + i + 1)
        if seq.finish_reason is not None:  # a stop string: the tokens after it go
            seq.truncate_output(first + i + 1)
            return i + 1
        seq.finish_reason, seq.stop_reason = reason, stop
    update_text(seq, text, token_ids[-1])
    return len(token_ids)


def make_output(request: Request) -> RequestOutput:
    """The request's state now, with what is new since the previous output as deltas. While a
    sample runs, the last (longest stop string - 1) characters are held back: they may yet turn
    out to begin a stop string that must not be shown."""
    outputs = []
    for seq, text in zip(request.sequences, request.texts):
        hold = 0
        if (
            not seq.is_finished
            and seq.params.stop_strings
            and not seq.params.include_stop_str_in_output
        ):
            hold = max(len(s) for s in seq.params.stop_strings) - 1
        visible = max(text.sent_chars, len(text.text) - hold)
        delta = text.text[text.sent_chars : visible]
        token_delta = seq.output_token_ids[text.sent_tokens :]
        text.sent_chars, text.sent_tokens = visible, seq.num_output_tokens
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=text.text[:visible] if not seq.is_finished else text.text,
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                text_delta=delta,
                token_ids_delta=token_delta,
            )
        )
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=request.finished,
        # The sample that ran the prompt; a copy, since the engine thread goes on appending to it.
        prompt_logprobs=list(request.sequences[0].prompt_logprobs)
        if request.sequences[0].prompt_logprobs is not None
        else None,
        # The prompt is cached once, by the sample that runs it; its siblings fork from it.
        num_cached_tokens=request.sequences[0].num_cached_tokens,
    )


def failed_output(request: Request, error: str) -> RequestOutput:
    """The last output of a request the engine failed: every completion ends with "error".
    Built from the token ids alone, since making its text may be what failed."""
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=seq.index,
                text="",
                token_ids=list(seq.output_token_ids),
                finish_reason="error",
            )
            for seq in request.sequences
        ],
        finished=True,
        num_cached_tokens=request.sequences[0].num_cached_tokens,
        error=error,
    )
