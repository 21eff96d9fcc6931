"""Usage over real HTTP, exact to the token: the prompt tokens the prefix cache served
(`usage.prompt_tokens_details.cached_tokens`), on both routes, streamed and not, read by the
official openai client.

Every test sends prompts no other test sends (a fresh uuid at their start), so the prefix cache
the shared server has filled elsewhere cannot serve any of their blocks by chance."""

from __future__ import annotations

import random
import uuid
from typing import Any

import openai
import pytest

from tests.prompts import TEXT
from tests.server_harness import RunningServer

JSON = dict[str, Any]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def block_size(server: RunningServer) -> int:
    return server.engine.info.block_size


def cached_after_a_first_run(prompt_len: int, block_size: int) -> int:
    """What the cache serves of a prompt that ran once before: its whole blocks, except the one
    holding the last prompt token, which is always recomputed (its logits are sampled)."""
    return (prompt_len - 1) // block_size * block_size


def unique_text(words: int = 120) -> str:
    return f"{uuid.uuid4().hex}: " + " ".join(TEXT.split()[:words])


def unique_token_ids(length: int) -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(100, 40_000) for _ in range(length)]


def cached_tokens(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    value = usage.prompt_tokens_details.cached_tokens
    assert isinstance(value, int)
    return value


def test_completion_reports_the_prompt_tokens_served_from_the_cache(
    client: openai.OpenAI, block_size: int
) -> None:
    prompt = unique_text()
    body: JSON = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**body)
    assert first.usage is not None
    prompt_len = first.usage.prompt_tokens
    assert prompt_len > 4 * block_size  # several blocks, so that a wrong count shows
    assert cached_tokens(first.usage) == 0

    expected = cached_after_a_first_run(prompt_len, block_size)
    assert expected > 0 and expected % block_size == 0
    second = client.completions.create(**body)
    assert second.usage is not None and second.usage.prompt_tokens == prompt_len
    assert cached_tokens(second.usage) == expected
    assert second.choices[0].text == first.choices[0].text

    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == []
    assert cached_tokens(chunks[-1].usage) == expected
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("whole_blocks", [True, False], ids=["k-blocks", "k-blocks-plus-one"])
def test_the_block_of_the_last_prompt_token_never_counts_as_cached(
    client: openai.OpenAI, block_size: int, whole_blocks: bool
) -> None:
    """A prompt of exactly 4 blocks gets 3 from the cache (its last token must be computed, so
    its block is); one token longer, all 4."""
    length = 4 * block_size + (0 if whole_blocks else 1)
    ids = unique_token_ids(length)
    body: JSON = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    assert cached_tokens(client.completions.create(**body).usage) == 0
    again = client.completions.create(**body).usage
    assert again is not None and again.prompt_tokens == length
    assert cached_tokens(again) == (3 if whole_blocks else 4) * block_size


def test_cached_tokens_count_each_prompt_once(client: openai.OpenAI, block_size: int) -> None:
    """Several prompts, several samples each: the cached tokens add up per prompt, as
    prompt_tokens do, not per sample."""
    seen, fresh = unique_token_ids(3 * block_size + 5), unique_token_ids(2 * block_size + 3)
    body: JSON = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    client.completions.create(**body, prompt=seen)
    out = client.completions.create(**body, prompt=[seen, fresh], n=3)
    assert out.usage is not None and out.usage.prompt_tokens == len(seen) + len(fresh)
    assert out.usage.completion_tokens == 2 * 3 * 2
    assert cached_tokens(out.usage) == 3 * block_size  # seen's 3 whole blocks; fresh: none


def test_a_prompt_that_needs_prompt_logprobs_is_computed_and_reports_none_cached(
    client: openai.OpenAI, block_size: int
) -> None:
    """echo with logprobs needs every prompt position's logits, so the cache is not used: the
    usage must say so rather than count the blocks it could have served."""
    ids = unique_token_ids(3 * block_size + 2)
    body: JSON = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    client.completions.create(**body)
    out = client.completions.create(**body, echo=True, logprobs=1)
    assert cached_tokens(out.usage) == 0
    assert cached_tokens(client.completions.create(**body).usage) == 3 * block_size


def test_chat_reports_the_prompt_tokens_served_from_the_cache(
    client: openai.OpenAI, block_size: int
) -> None:
    # The model's default system prompt opens every chat that has none, and so shares its first
    # block with other tests' chats: a system message of this test's own comes first instead.
    messages: Any = [
        {"role": "system", "content": unique_text(60)},
        {"role": "user", "content": "Summarize the story in one sentence."},
    ]
    body: JSON = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    first = client.chat.completions.create(**body)
    assert first.usage is not None
    prompt_len = first.usage.prompt_tokens
    assert prompt_len > 4 * block_size
    assert cached_tokens(first.usage) == 0

    expected = cached_after_a_first_run(prompt_len, block_size)
    second = client.chat.completions.create(**body)
    assert second.usage is not None and second.usage.prompt_tokens == prompt_len
    assert cached_tokens(second.usage) == expected

    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == []
    assert cached_tokens(chunks[-1].usage) == expected
