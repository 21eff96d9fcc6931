"""The server under concurrency and with clients that go away, over real HTTP on 127.0.0.1:
every concurrent stream gets exactly the offline engine's tokens; cancelled streams and
timed-out requests are aborted and give all their KV blocks back; an engine that fails
mid-stream ends every stream with an error event, then [DONE], and /health turns 503."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from config import ServerConfig
from engine import LLM, SamplingParams
from tests.conftest import SERVER_SETTINGS
from tests.support.server_harness import RunningServer, start_engine, wait_until_idle

SUBJECTS = [
    "rivers",
    "bread",
    "comets",
    "violins",
    "glaciers",
    "owls",
    "copper",
    "tides",
    "maps",
    "tea",
    "bridges",
    "moss",
    "clocks",
    "sails",
    "honey",
    "deserts",
]
PROMPTS = [f"Write one sentence about {s}." for s in SUBJECTS] + [
    f"Name a fact about {s}:" for s in SUBJECTS
]
MAX_TOKENS = 12


def _sse_events(body: str) -> list[str]:
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def test_32_concurrent_streams_match_offline_engine(
    server: RunningServer, default_model_dir: Path
) -> None:
    assert len(set(PROMPTS)) == 32
    offline = LLM(str(default_model_dir), **SERVER_SETTINGS)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    del offline

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, list[str | None]]:
        stream = await client.completions.create(
            model="smol",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, reasons = "", 0, []
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage, reasons

    async def main() -> list[tuple[str, int, list[str | None]]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(main())
    for prompt, want, (text, usage, reasons) in zip(PROMPTS, expected, results):
        assert text == want.outputs[0].text, prompt
        assert usage == len(want.outputs[0].token_ids)
        assert [r for r in reasons if r is not None] == [want.outputs[0].finish_reason]
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks


def test_cancelled_streams_and_timed_out_requests_free_everything(server: RunningServer) -> None:
    long = {"model": "smol", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}

    async def cancel_mid_stream(client: httpx.AsyncClient, i: int) -> int:
        body = {**long, "prompt": f"Story number {i}:", "stream": True}
        events = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                if events == 2 + i % 3:
                    break  # leaving the block closes the connection mid-stream
        return events

    async def time_out(client: httpx.AsyncClient, i: int) -> None:
        body = {**long, "messages": [{"role": "user", "content": f"Tell story {i}."}]}
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5)
            )

    async def main() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            events = await asyncio.gather(*(cancel_mid_stream(client, i) for i in range(20)))
            assert all(e >= 2 for e in events)
            await asyncio.gather(*(time_out(client, i) for i in range(20)))

    asyncio.run(main())
    state = wait_until_idle(server.engine)
    assert (state.running, state.waiting, state.requests) == (0, 0, 0)
    assert state.free_blocks == state.num_blocks
    after = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
        timeout=60,
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_engine_failure_mid_stream(llama_dir: Path) -> None:
    engine = start_engine(model=str(llama_dir), num_kv_blocks=64, max_model_len=256)
    running = RunningServer(engine, ServerConfig())
    inner = engine.engine
    real_step = inner.step
    steps = {"n": 0}

    def faulty_step():  # the test-only fault: the third step with both requests in it raises
        if len(inner.requests) == 2:
            steps["n"] += 1
            if steps["n"] == 3:
                raise RuntimeError("injected fault")
        return real_step()

    inner.step = faulty_step  # type: ignore[method-assign]
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 50, "temperature": 0, "ignore_eos": True}

        async def main() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                return await asyncio.gather(
                    client.post("/v1/completions", json={**body, "stream": True}),
                    client.post("/v1/completions", json=body),
                )

        streamed, plain = asyncio.run(main())
        assert streamed.status_code == 200
        events = _sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["type"] == "server_error"
        assert "injected fault" in error["error"]["message"]
        assert all("error" not in json.loads(e) for e in events[:-2])
        assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"

        health = httpx.get(running.url + "/health", timeout=10)
        assert health.status_code == 503 and "injected fault" in health.json()["error"]["message"]
        refused = httpx.post(running.url + "/v1/completions", json=body, timeout=10)
        assert (
            refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        )
    finally:
        running.stop()
        engine.shutdown()
