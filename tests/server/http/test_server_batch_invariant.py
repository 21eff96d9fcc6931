"""A server started with --batch-invariant, over real HTTP with the official client: 32 greedy
streams sent at once give each the tokens and logprobs it gets when sent alone (bfloat16, the
default model; tests/engine/test_batch_invariant.py shows the same workload without the flag
differing)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from config import ServerConfig
from kernels.cpu.packed_linear import fixed_order_available
from tests.support.prompts import cut_prompts
from tests.support.server_harness import RunningServer, start_engine

pytestmark = pytest.mark.skipif(
    not fixed_order_available(), reason="the fixed-order linear kernel needs AVX512-BF16"
)

STREAMS = 32
LENGTHS = [6 + 6 * i for i in range(STREAMS)]  # 6 to 192 tokens
Trace = list[tuple[str, float]]


@pytest.fixture(scope="module")
def invariant_server(default_model_dir: Path) -> Iterator[RunningServer]:
    engine = start_engine(
        model=str(default_model_dir),
        dtype="bfloat16",
        batch_invariant=True,
        max_num_seqs=STREAMS,
        max_num_batched_tokens=96,  # prompts cut where the budget runs out, unlike alone
        num_kv_blocks=1024,
    )
    server = RunningServer(engine, ServerConfig(served_model_name=["SmolLM2-135M-Instruct"]))
    yield server
    server.stop()
    engine.shutdown()


async def _stream(client: openai.AsyncOpenAI, prompt: list[int]) -> Trace:
    stream = await client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    trace: Trace = []
    async for chunk in stream:
        logprobs = chunk.choices[0].logprobs
        if logprobs is not None and logprobs.tokens:
            assert logprobs.token_logprobs is not None
            trace += [
                (t, float(lp or 0.0)) for t, lp in zip(logprobs.tokens, logprobs.token_logprobs)
            ]
    return trace


def test_streams_at_once_equal_each_alone(
    invariant_server: RunningServer, default_model_dir
) -> None:
    from transformers import AutoTokenizer

    prompts = cut_prompts(AutoTokenizer.from_pretrained(default_model_dir), LENGTHS)

    async def run() -> tuple[list[Trace], list[Trace]]:
        client = openai.AsyncOpenAI(
            base_url=invariant_server.url + "/v1", api_key="unused", max_retries=0, timeout=300
        )
        together = await asyncio.gather(*(_stream(client, p) for p in prompts))
        alone = [await _stream(client, p) for p in prompts]
        return list(together), alone

    together, alone = asyncio.run(run())
    assert all(len(trace) == 8 for trace in alone)
    assert together == alone
