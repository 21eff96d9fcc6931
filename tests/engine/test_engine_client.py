"""The server's view of the engine is the EngineClient protocol: frozen info, a submit that
checks a request before anything is queued, streams and abort. Checked on the default engine."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.async_engine import AsyncEngine
from engine.client import EngineClient, EngineRequest

SERVER = Path(__file__).resolve().parents[2] / "server"


def test_info_describes_the_running_engine(default_engine: AsyncEngine) -> None:
    info, inner = default_engine.info, default_engine.engine
    assert (info.max_model_len, info.vocab_size, info.block_size) == (
        inner.max_model_len,
        inner.vocab_size,
        inner.block_size,
    )
    assert info.num_kv_blocks == inner.kv.pool.num_blocks
    assert info.max_num_seqs == inner.config.scheduler.max_num_seqs
    # The frontend's tokenizer is its own copy: the engine thread detokenizes with the original.
    assert info.tokenizer is not inner.tokenizer
    assert info.tokenizer("a KV cache").input_ids == inner.tokenizer("a KV cache").input_ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([10**9], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(logprobs=21), "logprobs"),
        ([1, 2], SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
        ([1, 2], SamplingParams(n=10**4), "n"),
    ],
)
def test_validate_refuses_what_a_step_would_fail_on(
    default_engine: AsyncEngine, prompt: list[int], params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(default_engine.submit(EngineRequest("refused", prompt, prompt, params)))
    assert refused.value.param == param


def test_abort_ends_a_request_with_finish_reason_abort(default_engine: AsyncEngine) -> None:
    async def run() -> list[str | None]:
        params = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0)
        reasons = []
        stream = await default_engine.submit(EngineRequest("abort-me", "Once", [1, 2, 3], params))
        async for output in stream:
            if output.outputs[0].token_ids and not output.finished:
                default_engine.abort("abort-me")
            reasons.append(output.outputs[0].finish_reason)
        return reasons

    reasons = asyncio.run(run())
    assert reasons[-1] == "abort" and len(reasons) < 5000


def test_the_server_uses_only_the_client_surface() -> None:
    """Only the launcher names the implementation; every other module sees the protocol."""
    for path in SERVER.rglob("*.py"):
        text = path.read_text()
        assert "engine.engine" not in text, path
        if path.name != "launch.py":
            assert "engine.async_engine" not in text and "AsyncEngine" not in text, path


def test_the_async_engine_implements_the_client_protocol(default_engine: AsyncEngine) -> None:
    client: EngineClient = default_engine  # mypy checks the protocol; this checks the names
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert members and all(hasattr(client, name) for name in members)
    assert {"submit", "abort", "info", "is_alive"} <= set(members) | set(
        EngineClient.__annotations__
    )


def test_a_bad_request_fails_at_submit_with_nothing_queued(default_engine: AsyncEngine) -> None:
    async def run() -> None:
        good = SamplingParams(max_tokens=2)
        await default_engine.submit(EngineRequest("queued-never", [1, 2], [1, 2], good))
        with pytest.raises(InvalidRequestError) as refused:
            await default_engine.submit(
                EngineRequest("bad", [1, 2], [1, 2], SamplingParams(n=10**4))
            )
        assert refused.value.param == "n"

    asyncio.run(run())
    inner = default_engine.engine
    assert "queued-never" not in inner.requests and "bad" not in inner.requests
