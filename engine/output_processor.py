"""After each step: append sampled tokens, detokenize, check stop conditions, build outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request


@dataclass
class SequenceText:
    """The text of one sample and how much of it has been handed out."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0


@dataclass
class RequestGroup:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Request]
    texts: list[SequenceText] = field(default_factory=list)
    # Engine timestamps (time.time()) for the latency metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)


def check_stop(request: Request, token_id: int, max_model_len: int) -> None:
    """Token-level stop conditions, checked after `token_id` was appended."""
    params = request.params
    if token_id in params.stop_token_ids:
        request.finish_reason, request.stop_reason = "stop", token_id
    elif token_id == request.eos_token_id and not params.ignore_eos:
        request.finish_reason = "stop"
    elif params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.finish_reason = "length"
    elif request.num_tokens >= max_model_len:
        request.finish_reason = "length"


def update_text(request: Request, seq: SequenceText, token_id: int) -> None:
    """Detokenize the new token (unless it ended the sequence as a stop token) and look for
    stop strings, including ones that span several tokens."""
    params = request.params
    stopped_by_token = request.finish_reason == "stop"
    checked = len(seq.text)  # text before this token was already searched
    if not stopped_by_token:
        seq.text += seq.detokenizer.add(token_id)
    if request.finish_reason is not None:
        seq.text += seq.detokenizer.flush()  # an incomplete character held back, as decode shows it
    if not params.stop_strings or stopped_by_token:
        return
    # Only the new text, plus enough before it to catch a stop string spanning the boundary.
    longest = max(len(s) for s in params.stop_strings)
    window_start = max(0, checked - longest + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop_strings:
        idx = seq.text.find(stop, window_start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is not None:
        idx, stop = best
        seq.text = (
            seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
        )
        request.finish_reason, request.stop_reason = "stop", stop


def make_output(group: RequestGroup) -> RequestOutput:
    """The group's state now, with what is new since the previous output as deltas. While a
    sample runs, the last (longest stop string - 1) characters are held back: they may yet turn
    out to begin a stop string that must not be shown."""
    outputs = []
    for seq, text in zip(group.sequences, group.texts):
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
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        outputs=outputs,
        finished=group.finished,
        # The sample that ran the prompt; a copy, since the engine thread goes on appending to it.
        prompt_logprobs=list(group.sequences[0].prompt_logprobs)
        if group.sequences[0].prompt_logprobs is not None
        else None,
    )
