"""The server's view of the engine is AsyncEngine's client surface: frozen info, a validate that
reads only that info, generate and abort. Checked on the default engine."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.async_engine import AsyncEngine

SERVER = Path(__file__).resolve().parent.parent / "server"


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
        default_engine.validate(prompt, params)
    assert refused.value.param == param


def test_abort_ends_a_request_with_finish_reason_abort(default_engine: AsyncEngine) -> None:
    async def run() -> list[str | None]:
        params = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0)
        reasons = []
        async for output in default_engine.generate("Once", params, "abort-me", [1, 2, 3]):
            if output.outputs[0].token_ids and not output.finished:
                default_engine.abort("abort-me")
            reasons.append(output.outputs[0].finish_reason)
        return reasons

    reasons = asyncio.run(run())
    assert reasons[-1] == "abort" and len(reasons) < 5000


def test_the_server_uses_only_the_client_surface() -> None:
    for path in SERVER.glob("*.py"):
        assert "engine.engine" not in path.read_text(), path.name
