"""The server with async scheduling answers exactly as the same server without it, over real HTTP
with the official client, on the default model in float32 under a KV pool small enough to preempt
and a token budget small enough to chunk: streamed completions with stop strings, seeded
sampling with every penalty and logprobs, forced tools and a JSON schema in chat, and a stream
left early; /metrics counts the same tokens and request ends on both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from config import ServerConfig
from server.app import attach_metrics
from tests.support.server_harness import (
    MODEL,
    RunningServer,
    Samples,
    scrape,
    start_engine,
    value,
    wait_until_idle,
)


@pytest.fixture(scope="module")
def servers(default_model_dir: Path) -> Iterator[dict[bool, RunningServer]]:
    running: dict[bool, RunningServer] = {}
    try:
        for flag in (False, True):
            engine = start_engine(
                model=str(default_model_dir),
                dtype="float32",
                num_kv_blocks=10,  # 160 tokens for 8 sequences of up to ~100: preemption
                max_model_len=160,
                max_num_batched_tokens=40,
                max_num_seqs=6,
                async_scheduling=flag,
            )
            config = ServerConfig(served_model_name=[MODEL])
            running[flag] = RunningServer(engine, config, attach_metrics(engine, config))
        yield running
    finally:
        for server in running.values():
            server.stop()
            server.engine.shutdown()


PROMPTS = [
    "The history of the printing press begins",
    "Write a short list of three fruits:",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


async def streamed_completion(client: openai.AsyncOpenAI, i: int) -> dict[str, Any]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPTS[i],
        max_tokens=48,
        temperature=0.9,
        seed=100 + i,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logprobs=2,
        stop=[".", "\n\n"] if i % 2 else None,
        stream=True,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4},
    )
    text, tokens, reasons = "", [], []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens.extend(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))
            reasons.append(choice.finish_reason)
    return {"text": text, "logprobs": tokens, "finish": [r for r in reasons if r]}


async def forced_tool(client: openai.AsyncOpenAI) -> Any:
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.finish_reason, calls


async def json_schema(client: openai.AsyncOpenAI) -> Any:
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
        max_tokens=60,
        temperature=1.0,
        seed=5,
        n=2,
    )
    return [(c.message.content, c.finish_reason) for c in reply.choices]


async def left_early(client: openai.AsyncOpenAI) -> list[str]:
    """A stream read for three chunks, then closed: its request is aborted."""
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=60, temperature=0, stream=True
    )
    seen = []
    async for chunk in stream:
        seen.append(chunk.choices[0].text)
        if len(seen) == 3:
            break
    await stream.close()
    return seen


async def workload(url: str) -> list[Any]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(
            *(streamed_completion(client, i) for i in range(len(PROMPTS))),
            forced_tool(client),
            json_schema(client),
            left_early(client),
        )


COUNTERS = ("prompt_tokens_total", "generation_tokens_total")
REASONS = ("stop", "length", "abort")


def counted(before: Samples, after: Samples) -> dict[str, float]:
    counts = {name: value(after, name) - value(before, name) for name in COUNTERS}
    for reason in REASONS:
        name = "request_success_total"
        counts[reason] = value(after, name, finished_reason=reason) - value(
            before, name, finished_reason=reason
        )
    return counts


def test_answers_and_counts_equal_the_synchronous_server(servers: dict[bool, RunningServer]):
    results = {}
    preemptions = {}
    for flag, server in servers.items():
        before = scrape(server.url)
        answers = asyncio.run(workload(server.url))
        state = wait_until_idle(server.engine)
        assert state.free_blocks == state.num_blocks
        after = scrape(server.url)
        results[flag] = (answers, counted(before, after))
        preemptions[flag] = value(after, "num_preemptions_total") - value(
            before, "num_preemptions_total"
        )
    (sync_answers, sync_counts), (async_answers, async_counts) = results[False], results[True]
    # Logprob values in float32 differ in their last digits between any two runs of either
    # server (requests meet in other batches as they arrive): tokens and text are exact.
    for sync_answer, async_answer in zip(sync_answers, async_answers, strict=True):
        if isinstance(sync_answer, dict):
            sync_lp, async_lp = sync_answer.pop("logprobs"), async_answer.pop("logprobs")
            assert [t for t, _ in async_lp] == [t for t, _ in sync_lp]
            assert [lp for _, lp in async_lp] == pytest.approx([lp for _, lp in sync_lp], abs=1e-3)
    assert async_answers == sync_answers
    assert async_counts == sync_counts
    # What the workload is for: sampled streams stopped by strings and by length, a forced
    # call, typed JSON, an abort, under preemption.
    completions = sync_answers[: len(PROMPTS)]
    assert {r for c in completions for r in c["finish"]} == {"stop", "length"}
    finish, calls = sync_answers[len(PROMPTS)]
    assert finish == "tool_calls"
    assert calls and calls[0][0] == "get_weather" and set(json.loads(calls[0][1])) >= {"city"}
    assert sync_counts["abort"] == 1 and sync_counts["generation_tokens_total"] > 0
    # Preempted on both (how often depends on when requests arrive, and on how long a
    # finished sequence's blocks stay held: one step longer with async scheduling).
    assert all(preemptions.values())
    engine = servers[True].engine.engine
    assert engine._pipeline is not None
