"""Stop conditions: stop strings (within a token, across tokens, from mid-token), stop token
ids, EOS, max_tokens and max_model_len, with streamed deltas that never reveal a stop string.

The output processor is driven the way LLMEngine.step drives it, with chosen "sampled" tokens
(the encoding of a known text), so every expected result follows from the text itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.core.sequence import Sequence, SequenceStatus
from engine.core.stop_conditions import check_stop
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.outputs import CompletionOutput
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.output_processor import make_output, update_text
from engine.processing.request import Request, SequenceText
from engine.sampling_params import SamplingParams
from tests.support.models import tokenizer_dir

TEXT = "The quick brown fox jumps over the lazy dog. Then it sleeps."


@dataclass
class Run:
    outputs: list[CompletionOutput]  # one per step, as streamed

    @property
    def final(self) -> CompletionOutput:
        return self.outputs[-1]


@pytest.fixture(scope="module", params=["qwen", "llama"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(tokenizer_dir(request.param))


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def generate(
    tokenizer, tokens: list[int], params: SamplingParams, max_model_len: int = 4096
) -> Run:
    """Feed `tokens` as if sampled one per step, until the seq finishes."""
    prompt = list(tokenizer("Tell me a story:").input_ids)
    seq = Sequence(
        seq_id="r",
        request_id="r",
        index=0,
        prompt_token_ids=prompt,
        params=params,
        arrival_time=0.0,
        eos_token_id=tokenizer.eos_token_id,
        status=SequenceStatus.RUNNING,
    )
    request = Request(
        "r",
        None,
        prompt,
        [seq],
        [SequenceText(IncrementalDetokenizer(tokenizer, prompt, params.skip_special_tokens))],
    )
    outputs = []
    for token in tokens:
        seq.append_token(token)
        check_stop(seq, token, max_model_len)
        update_text(seq, request.texts[0], token)
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED  # what scheduler.finish does
        outputs.append(make_output(request).outputs[0])
        if seq.is_finished:
            break
    assert seq.is_finished, "ran out of tokens before a stop condition"
    return Run(outputs)


def tokens_until(tokenizer, ids: list[int], stop: str) -> int:
    """How many tokens it takes until the decoded text contains `stop`."""
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


def assert_stream_consistent(run: Run) -> None:
    """Streamed text never runs ahead of the final text (so never shows an excluded stop
    string), each output's text is what was streamed so far, and the deltas add up."""
    streamed = ""
    for i, out in enumerate(run.outputs):
        streamed += out.text_delta
        assert run.final.text.startswith(streamed), (i, streamed)
        assert out.text == streamed
    assert streamed == run.final.text
    assert [t for o in run.outputs for t in o.token_ids_delta] == run.final.token_ids


@pytest.mark.parametrize(
    "stop",
    [
        "row",  # inside the single token " brown"
        " fox jumps over",  # exactly three whole tokens
        "own fox ju",  # begins inside " brown", ends inside " jumps"
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string(tokenizer, stop: str, include: bool) -> None:
    ids = encode(tokenizer, TEXT)
    run = generate(
        tokenizer,
        ids,
        SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=100),
    )
    idx = TEXT.index(stop)
    assert run.final.text == (TEXT[: idx + len(stop)] if include else TEXT[:idx])
    assert run.final.finish_reason == "stop"
    assert run.final.stop_reason == stop
    # Generation ends at the token that completes the stop string; that token stays in token_ids.
    assert run.final.token_ids == ids[: tokens_until(tokenizer, ids, stop)]
    assert_stream_consistent(run)


def test_stop_string_hold_back_is_tight(tokenizer) -> None:
    """While running, at most len(longest stop) - 1 characters are held back, and a suffix that
    never becomes a stop string is released in the end."""
    ids = encode(tokenizer, TEXT)
    stops = ["dog!", "sleeping"]  # never occur, but prefixes of them do ("dog", "sleep")
    run = generate(tokenizer, ids, SamplingParams(stop=stops, max_tokens=len(ids)))
    assert (
        run.final.text == TEXT
        and run.final.finish_reason == "length"
        and run.final.stop_reason is None
    )
    hold = max(len(s) for s in stops) - 1
    streamed = ""
    for k, out in enumerate(run.outputs[:-1], start=1):
        streamed += out.text_delta
        decoded = tokenizer.decode(ids[:k])
        assert streamed == decoded[: max(0, len(decoded) - hold)]
    assert_stream_consistent(run)


def test_stop_string_not_shown_while_streaming(tokenizer) -> None:
    # "lazy dog" builds up over two tokens; no streamed output may show "lazy" or "lazy d...".
    ids = encode(tokenizer, TEXT)
    run = generate(tokenizer, ids, SamplingParams(stop="lazy dog", max_tokens=100))
    assert run.final.text == "The quick brown fox jumps over the "
    for out in run.outputs:
        assert "la" not in out.text_delta and "la" not in out.text
    assert_stream_consistent(run)


@pytest.mark.parametrize(
    ("stops", "winner"),
    [
        (["lazy", "fox"], "fox"),  # the earliest occurrence wins, not the first listed
        (["own", "bro"], "bro"),  # both complete in the same token " brown"
        (
            ["fox", "quick brown fox"],
            "quick brown fox",
        ),  # both complete at " fox"; the longer starts first
    ],
)
def test_earliest_stop_string_wins(tokenizer, stops: list[str], winner: str) -> None:
    ids = encode(tokenizer, TEXT)
    run = generate(tokenizer, ids, SamplingParams(stop=stops, max_tokens=100))
    assert run.final.text == TEXT[: TEXT.index(winner)]
    assert (run.final.finish_reason, run.final.stop_reason) == ("stop", winner)
    assert_stream_consistent(run)


def test_stop_string_with_split_emoji(tokenizer) -> None:
    # The emoji takes several byte-level tokens; the stop string begins in the middle of it.
    text = "Let us party 🎉🥳 tonight and then rest."
    ids = encode(tokenizer, text)
    stop = "🥳 tonight"
    run = generate(tokenizer, ids, SamplingParams(stop=stop, max_tokens=100))
    assert run.final.text == "Let us party 🎉"
    assert run.final.stop_reason == stop
    assert run.final.token_ids == ids[: tokens_until(tokenizer, ids, stop)]
    for out in run.outputs:
        assert "\ufffd" not in out.text_delta
    assert_stream_consistent(run)


def test_stop_token_id(tokenizer) -> None:
    ids = encode(tokenizer, TEXT)
    stop_at = 10  # " Then"
    assert ids[stop_at] not in ids[:stop_at]
    run = generate(tokenizer, ids, SamplingParams(stop_token_ids=[ids[stop_at]], max_tokens=100))
    assert run.final.token_ids == ids[: stop_at + 1]  # the stop token is in token_ids ...
    assert run.final.text == tokenizer.decode(ids[:stop_at])  # ... but not in the text
    assert run.final.text == "The quick brown fox jumps over the lazy dog."
    assert (run.final.finish_reason, run.final.stop_reason) == ("stop", ids[stop_at])
    assert_stream_consistent(run)


def test_eos_finishes_unless_ignored(tokenizer) -> None:
    ids = encode(tokenizer, TEXT)
    eos = tokenizer.eos_token_id
    tokens = ids[:4] + [eos] + ids[4:]

    run = generate(tokenizer, tokens, SamplingParams(max_tokens=100))
    assert run.final.token_ids == ids[:4] + [eos]
    assert run.final.text == "The quick brown fox"
    assert (run.final.finish_reason, run.final.stop_reason) == ("stop", None)
    assert_stream_consistent(run)

    run = generate(tokenizer, tokens, SamplingParams(max_tokens=len(tokens), ignore_eos=True))
    assert run.final.token_ids == tokens
    assert run.final.text == TEXT  # EOS is a special token: skipped in the text
    assert run.final.finish_reason == "length"
    assert_stream_consistent(run)

    # ignore_eos concerns EOS only: an explicit stop token id still stops, even when it is EOS.
    run = generate(
        tokenizer, tokens, SamplingParams(max_tokens=100, ignore_eos=True, stop_token_ids=[eos])
    )
    assert run.final.token_ids == ids[:4] + [eos]
    assert (run.final.finish_reason, run.final.stop_reason) == ("stop", eos)


def test_max_tokens(tokenizer) -> None:
    ids = encode(tokenizer, TEXT)
    run = generate(tokenizer, ids, SamplingParams(max_tokens=5))
    assert run.final.token_ids == ids[:5]
    assert run.final.text == tokenizer.decode(ids[:5])
    assert (run.final.finish_reason, run.final.stop_reason) == ("length", None)
    assert len(run.outputs) == 5 and all(o.finish_reason is None for o in run.outputs[:-1])
    assert_stream_consistent(run)


def test_max_model_len(tokenizer) -> None:
    ids = encode(tokenizer, TEXT)
    num_prompt = len(tokenizer("Tell me a story:").input_ids)
    for max_tokens in (None, 50):  # the context limit applies whatever max_tokens allows
        run = generate(
            tokenizer, ids, SamplingParams(max_tokens=max_tokens), max_model_len=num_prompt + 3
        )
        assert run.final.token_ids == ids[:3]
        assert run.final.finish_reason == "length"
        assert run.final.text == tokenizer.decode(ids[:3])


@pytest.fixture(scope="module")
def llm(qwen2_dir: Path) -> LLM:
    return LLM(str(qwen2_dir), num_kv_blocks=32, max_model_len=128, max_num_seqs=4)


def test_end_to_end_stop_string(llm: LLM) -> None:
    prompt = "Hello, my name is"
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[
        0
    ].outputs[0]
    text = first.text
    # The 3-character piece of the output that first appears latest (random weights repeat a lot).
    windows = [text[i : i + 3] for i in range(len(text) - 2) if "\ufffd" not in text[i : i + 3]]
    stop = max(windows, key=text.index)
    cut = text.index(stop)
    assert cut > 0

    for include in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=include,
        )
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.text == (text[: cut + len(stop)] if include else text[:cut])
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        # Same greedy tokens, up to the one that completed the stop string.
        assert out.token_ids == first.token_ids[: len(out.token_ids)]
        assert stop in llm.tokenizer.decode(out.token_ids)
        assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_min_tokens_holds_back_eos_and_stop_token_ids(llm: LLM) -> None:
    """A logit bias makes EOS (then a stop token id) the greedy choice at every step: without
    min_tokens the output ends at once; with it, exactly min_tokens other tokens come first."""
    eos = llm.engine.tokenizer.eos_token_id
    prompt = "Hello, my name is"
    forced = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0})
    out = llm.generate(prompt, forced)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")
    out = llm.generate(prompt, replace(forced, min_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"

    stop_id = out.token_ids[0]  # any token: biased up and listed as a stop token id
    by_id = SamplingParams(
        temperature=0.0, max_tokens=12, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id]
    )
    out = llm.generate(prompt, by_id)[0].outputs[0]
    assert (out.token_ids, out.stop_reason) == ([stop_id], stop_id)
    out = llm.generate(prompt, replace(by_id, min_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == stop_id
    assert stop_id not in out.token_ids[:3]


def test_min_tokens_holds_back_stop_strings(llm: LLM) -> None:
    """A stop string that completes within the first min_tokens tokens is not a stop; the first
    one completed after them is."""
    prompt = "Hello, my name is"
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = llm.generate(prompt, greedy)[0].outputs[0]
    stop = llm.engine.tokenizer.decode(first.token_ids[:1])
    params = replace(greedy, stop=stop)
    assert len(llm.generate(prompt, params)[0].outputs[0].token_ids) == 1
    out = llm.generate(prompt, replace(params, min_tokens=24))[0].outputs[0]
    assert out.token_ids == first.token_ids and out.finish_reason == "length"


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
