"""A stream whose reader falls behind gets several tokens per event, and not one is lost.

The server runs over the benchmark's stand-in engine (bench/serving/standin_engine.py: the real bridge,
real outputs and detokenizer on the default model's tokenizer) stepping as fast as its thread
can: tokens come faster than the frontend can send one event each, as they do from a GPU at
hundreds of streams. The official client reads slowly on top of that. Every streamed answer is
checked against the same request answered whole (the stand-in's tokens depend on the prompt
alone): the joined text, one logprob per token, the finish reason and the usage.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config import ServerConfig
from engine.async_engine import AsyncEngine
from tests.support.server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "serving"))
from standin_engine import start_standin

MODEL = "standin"
TOKENS = 200  # per choice: enough for a stream to fall behind many times over
READ_PAUSE = 0.001  # the client's pause after each event it reads


@pytest.fixture(scope="module")
def standin() -> Iterator[AsyncEngine]:
    engine = start_standin(step_s=0.0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(standin: AsyncEngine) -> Iterator[openai.OpenAI]:
    server = RunningServer(standin, ServerConfig(served_model_name=[MODEL], responses_store="none"))
    try:
        with openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as c:
            yield c
    finally:
        server.stop()


def test_completions_slow_reader_gets_every_token_in_fewer_events(
    client: openai.OpenAI,
) -> None:
    prompts = ["The river ran", "Tell me about the café"]
    request = {
        "model": MODEL,
        "prompt": prompts,
        "n": 2,
        "max_tokens": TOKENS,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**request)  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, int] = defaultdict(int)
    events: dict[int, int] = defaultdict(int)
    finish: dict[int, str | None] = {}
    usage = None
    stream = client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            events[choice.index] += 1
            texts[choice.index] += choice.text
            assert choice.logprobs is not None and choice.logprobs.tokens is not None
            tokens[choice.index] += len(choice.logprobs.tokens)
            assert choice.index not in finish, "a chunk after the choice's finish"
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        time.sleep(READ_PAUSE)
    assert sorted(texts) == [0, 1, 2, 3]
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == TOKENS
        assert finish[c.index] == "length"
        assert events[c.index] < TOKENS, "no event carried more than one token"
    # Prompts differ, and so do their texts: a merge across prompts would show here.
    assert texts[0] != texts[2]
    assert usage is not None and usage.completion_tokens == 4 * TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_chat_slow_reader_gets_every_token_in_fewer_events(client: openai.OpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the river."}],
        "n": 2,
        "max_tokens": TOKENS,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    content: dict[int, str] = defaultdict(str)
    logprobs: dict[int, int] = defaultdict(int)
    events: dict[int, int] = defaultdict(int)
    finish: dict[int, str | None] = {}
    usage = None
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            events[choice.index] += 1
            content[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content is not None:
                for position in choice.logprobs.content:
                    assert len(position.top_logprobs) == 2
                logprobs[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        time.sleep(READ_PAUSE)
    assert sorted(content) == [0, 1]
    for c in whole.choices:
        assert content[c.index] == c.message.content
        assert logprobs[c.index] == TOKENS
        assert finish[c.index] == "length"
        # One event is the role's; every other carried at least one token.
        assert events[c.index] < TOKENS, "no event carried more than one token"
    assert content[0] != content[1]  # each sample its own text, none merged into another's
    assert usage is not None and usage.completion_tokens == 2 * TOKENS
