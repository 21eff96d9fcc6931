"""engine/coalesce.py: which queued outputs of a request merge, and what the merge carries."""

from __future__ import annotations

from engine.coalesce import coalesce
from engine.outputs import CompletionOutput, RequestOutput


def _sample(index: int, ids: list[int], text: str, new: int, new_text: str) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=ids,
        logprobs=[{t: -1.0} for t in ids],
        text_delta=new_text,
        token_ids_delta=ids[-new:],
    )


def _output(*samples: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(samples), finished)


def test_merge_joins_each_samples_deltas_and_keeps_the_later_state() -> None:
    earlier = _output(_sample(0, [5], "a", 1, "a"), _sample(1, [7], "x", 1, "x"))
    later = _output(
        _sample(0, [5, 6], "ab", 1, "b"),
        _sample(1, [7, 8], "xy", 1, "y"),
        finished=True,
    )
    later.outputs[1].finish_reason = "length"
    merged = coalesce(earlier, later)
    assert merged is not None and merged.finished
    by_index = {c.index: c for c in merged.outputs}
    assert (by_index[0].text_delta, by_index[0].token_ids_delta) == ("ab", [5, 6])
    assert (by_index[1].text_delta, by_index[1].token_ids_delta) == ("xy", [7, 8])
    assert by_index[1].finish_reason == "length"
    assert by_index[0].logprobs is not None and len(by_index[0].logprobs) == 2


def test_a_finished_or_failed_output_is_never_merged_into_another() -> None:
    finished = _output(_sample(0, [5], "a", 1, "a"), finished=True)
    assert coalesce(finished, _output(_sample(0, [5, 6], "ab", 1, "b"))) is None
    failed = _output(_sample(0, [5], "a", 1, "a"))
    failed.error = "boom"
    assert coalesce(failed, _output(_sample(0, [5, 6], "ab", 1, "b"))) is None


def test_beam_search_first_empty_output_merges_into_the_finished_beams() -> None:
    # A search's first output has no samples; its last carries every beam whole.
    beams = _output(_sample(0, [5, 6], "ab", 2, "ab"), _sample(1, [5, 7], "ac", 2, "ac"))
    merged = coalesce(_output(), beams)
    assert merged is beams and [c.text_delta for c in merged.outputs] == ["ab", "ac"]


def test_outputs_with_a_sample_the_later_lacks_stay_apart() -> None:
    earlier = _output(_sample(0, [5], "a", 1, "a"), _sample(1, [7], "x", 1, "x"))
    assert coalesce(earlier, _output(_sample(0, [5, 6], "ab", 1, "b"))) is None
