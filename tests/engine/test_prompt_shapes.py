"""Every prompt shape vLLM's offline API takes (a text, token ids, `{"prompt": ...}`,
`{"prompt_token_ids": ...}`) gives the same generation and the same beam search on the default
model; a malformed prompt is refused up front, naming what is taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, BeamSearchParams, InvalidRequestError, SamplingParams

TEXT = "The capital of France is"
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    with LLM(
        str(default_model_dir), num_kv_blocks=NUM_BLOCKS, max_model_len=256, max_num_seqs=8
    ) as llm:
        yield llm


def shapes(llm: LLM) -> list[object]:
    ids = llm.tokenizer.encode(TEXT)
    return [TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids}]


def test_beam_search_takes_every_shape_with_equal_results(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    # The reported failure: a list of TokensPrompt dicts, vLLM's documented call.
    results = llm.beam_search(shapes(llm), params)  # type: ignore[arg-type]
    assert len(results) == 4
    first = [(s.tokens, s.text, s.cum_logprob) for s in results[0].sequences]
    assert len({tuple(s.tokens) for s in results[0].sequences}) == 3  # three distinct beams
    for result in results[1:]:
        assert [(s.tokens, s.text, s.cum_logprob) for s in result.sequences] == first
    # One prompt given alone, not in a list, is one search too. (Alone it runs in a smaller
    # batch, whose bfloat16 matmuls round differently: equal logprobs only to 1e-4.)
    (alone,) = llm.beam_search({"prompt": TEXT}, params)  # type: ignore[arg-type]
    assert [(s.tokens, s.text) for s in alone.sequences] == [(t, x) for t, x, _ in first]
    assert [s.cum_logprob for s in alone.sequences] == pytest.approx(
        [c for _, _, c in first], abs=1e-4
    )


def test_generate_takes_every_shape_with_equal_results(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(shapes(llm), params)  # type: ignore[arg-type]
    ids = llm.tokenizer.encode(TEXT)
    assert [o.prompt_token_ids for o in outputs] == [ids] * 4
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert len(tokens[0]) == 8 and tokens == [tokens[0]] * 4
    (alone,) = llm.generate({"prompt_token_ids": ids}, params)  # type: ignore[arg-type]
    assert alone.outputs[0].token_ids == tokens[0]


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ({"prompt_token_ids": "1 2 3"}, "'prompt_token_ids' holds a str"),
        ({"prompt_token_ids": [1, "2"]}, "'prompt_token_ids' holds a list"),
        ({"prompt": [1, 2]}, "'prompt' holds a list"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "keys ['prompt', 'prompt_token_ids']"),
        ({"prompt": "a", "cache_salt": "s"}, "keys ['cache_salt', 'prompt']"),
        ({}, "keys []"),
        (3.5, "got float"),
        ([[1, 2]], "got list"),
    ],
)
def test_malformed_prompts_are_refused_by_position(llm: LLM, prompt: object, words: str) -> None:
    for call in (
        lambda: llm.beam_search(["fine", prompt], BeamSearchParams(beam_width=2, max_tokens=2)),  # type: ignore[list-item]
        lambda: llm.generate(["fine", prompt], SamplingParams(max_tokens=2)),  # type: ignore[list-item]
    ):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert info.value.param == "prompt"
        assert str(info.value).startswith("prompt 1: expected a text, a list of token ids")
        assert words in str(info.value)
    # Refused before anything was queued: the engine holds nothing of that batch.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == NUM_BLOCKS
