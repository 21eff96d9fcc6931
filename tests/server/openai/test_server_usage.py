"""Usage over real HTTP, exact to the token: the prompt tokens the prefix cache served
(`usage.prompt_tokens_details.cached_tokens`), on both routes, streamed and not, read by the
official openai client; and the usage so far on every chunk of a stream
(`stream_options.continuous_usage_stats`), read from the raw events.

Every test sends prompts no other test sends (a fresh uuid at their start), so the prefix cache
the shared server has filled elsewhere cannot serve any of their blocks by chance."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.prompts import TEXT
from tests.support.server_harness import RunningServer

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


# --------------------------------------------------------------------------- continuous usage

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def stream_chunks(http: httpx.Client, path: str, body: JSON) -> list[JSON]:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def usage(prompt: int, completion: int, cached: int | None) -> JSON:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


def test_completion_chunks_carry_the_usage_so_far(http: httpx.Client) -> None:
    """Each chunk's completion_tokens is the number of tokens streamed up to and including it
    (logprobs=0 lists each chunk's tokens), over both samples of both prompts; the final usage
    chunk still comes, and equals the last running count."""
    prompts = [unique_text(20), unique_text(25)]
    body: JSON = {
        "prompt": prompts,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream_options": CONTINUOUS,
    }
    prompt_tokens = sum(
        len(http.post("/tokenize", json={"prompt": p}).json()["tokens"]) for p in prompts
    )
    chunks = stream_chunks(http, "/v1/completions", body)
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] == usage(prompt_tokens, 4 * 5, 0)
    streamed = 0
    for chunk in content:
        (choice,) = chunk["choices"]
        streamed += len(choice["logprobs"]["tokens"])
        got = chunk["usage"]
        # The hit of a prompt not yet admitted is not known yet: no details until both are.
        cached = None if got["prompt_tokens_details"] is None else 0
        assert got == usage(prompt_tokens, streamed, cached)
    assert streamed == 20 and content[-1]["usage"] == last["usage"]
    assert content[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_chat_chunks_carry_the_usage_so_far(http: httpx.Client, block_size: int) -> None:
    """The role chunks carry the prompt and no completion tokens; every later one the tokens
    streamed so far and, the request being admitted by then, the cache hit of its prompt."""
    messages = [
        {"role": "system", "content": unique_text(40)},
        {"role": "user", "content": "Go on with the story."},
    ]
    body: JSON = {
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
    }
    first = http.post("/v1/chat/completions", json=body).json()["usage"]
    prompt_tokens = first["prompt_tokens"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = cached_after_a_first_run(prompt_tokens, block_size)
    assert cached > 0

    chunks = stream_chunks(http, "/v1/chat/completions", {**body, "stream_options": CONTINUOUS})
    role, *content, last = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"] == usage(prompt_tokens, 0, None)
    assert last["choices"] == [] and last["usage"] == usage(prompt_tokens, 6, cached)
    streamed = 0
    for chunk in content:
        streamed += len(chunk["choices"][0]["logprobs"]["content"])
        assert chunk["usage"] == usage(prompt_tokens, streamed, cached)
    assert streamed == 6


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_without_include_usage_adds_nothing(
    http: httpx.Client, path: str
) -> None:
    """As vLLM reads it: continuous_usage_stats only adds to include_usage."""
    body: JSON = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    chunks = stream_chunks(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks)
    plain = stream_chunks(http, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] is not None


def test_continuous_usage_through_the_openai_sdk(client: openai.OpenAI) -> None:
    """The SDK parses every chunk's usage; logprobs=0 shows each chunk's tokens to count."""
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=unique_text(20),
            max_tokens=4,
            temperature=0,
            logprobs=0,
            stream=True,
            stream_options=CONTINUOUS,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
    )
    *content, last = chunks
    streamed = 0
    for chunk in content:
        logprobs = chunk.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None
        streamed += len(logprobs.tokens)
        assert chunk.usage is not None and chunk.usage.completion_tokens == streamed
    assert streamed == 4
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4
