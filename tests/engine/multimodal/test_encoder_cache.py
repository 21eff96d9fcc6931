"""The encoder cache's bookkeeping: a chunk stops before an image that neither the step's
budget nor the cache can take, outputs stay while a sequence still reads them and are evicted
least recently used after, and spans that must be computed whole (Gemma 3's) are never cut or
begun from a prefix hit inside them."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageItem, MultiModalInputs


def image(key: bytes, offset: int, length: int) -> ImageItem:
    return ImageItem(key, offset, length, tuple(range(length)), {"x": torch.zeros(1)})


A, B = image(b"a", 2, 4), image(b"b", 10, 4)
PROMPT = MultiModalInputs((A, B))


def test_a_chunk_stops_before_an_image_the_budget_cannot_take() -> None:
    cache = EncoderCache(capacity=8)
    num_new, plan = cache.plan(PROMPT, 0, 16, budget=4, planned=set())
    assert num_new == 10 and plan.encode == [A]  # b waits for the next step's budget
    cache.commit("s", plan)
    num_new, plan = cache.plan(PROMPT, 10, 6, budget=4, planned=set())
    assert num_new == 6 and plan.encode == [B] and plan.read == [B]


def test_outputs_stay_while_read_and_are_evicted_after() -> None:
    cache = EncoderCache(capacity=4)
    _, plan = cache.plan(PROMPT, 0, 8, budget=4, planned=set())
    cache.commit("s", plan)
    # No room for b while s still reads a: the chunk stops before b.
    assert cache.plan(PROMPT, 8, 8, budget=4, planned=set())[0] == 2
    cache.passed("s", PROMPT, 8)  # s is past a: its output may go
    num_new, plan = cache.plan(PROMPT, 8, 8, budget=4, planned=set())
    assert num_new == 8 and plan.encode == [B]
    cache.commit("s", plan)
    assert cache.take_evicted() == [b"a"] and list(cache.rows) == [b"b"]
    assert (cache.queries, cache.hits, cache.encoded) == (2, 0, 2)


def test_an_image_encoded_by_another_chunk_of_the_step_is_not_encoded_twice() -> None:
    cache = EncoderCache(capacity=8)
    _, plan = cache.plan(PROMPT, 0, 8, budget=8, planned={b"a"})
    assert plan.encode == [] and plan.read == [A]


def test_whole_spans_are_never_cut_nor_begun_inside() -> None:
    cache = EncoderCache(capacity=8, whole_spans=True)
    num_new, plan = cache.plan(PROMPT, 0, 12, budget=8, planned=set())
    assert num_new == 10 and plan.read == [A] and plan.encode == [A]  # b's span ends at 14
    assert cache.whole_span_start(PROMPT, 4) == 2  # a prefix hit inside a's span stops before it
    assert cache.whole_span_start(PROMPT, 8) == 8
    with pytest.raises(InvalidRequestError, match="takes 4 prompt tokens, computed in one step"):
        cache.check_fits(PROMPT, chunk_limit=3)
    assert EncoderCache(capacity=8).whole_span_start(PROMPT, 4) == 4  # causal spans may split


def test_an_image_larger_than_the_cache_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="needs 4 encoder rows"):
        EncoderCache(capacity=3).check_fits(PROMPT, chunk_limit=64)
