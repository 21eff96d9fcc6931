"""The engine thread and its asyncio bridge: outputs reach each request's own queue, leaving
early aborts, a bad request fails alone, a failed step fails everyone (no hang), shutdown
aborts what is in flight."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from config import EngineConfig
from engine import InvalidRequestError, LLMEngine, RequestOutput, SamplingParams
from engine.async_engine import AsyncEngine
from engine.client import EngineDeadError, EngineRequest, RequestFailedError
from engine.errors import ModelLoadError
from engine.stats import EngineStats
from tests.support.models import finish_all
from tests.support.server_harness import start_engine, wait_until_idle

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(100 + 7 * i, 130 + 11 * i)) for i in range(6)]


def _settings(folder: Path) -> dict[str, object]:
    return {
        "model": str(folder),
        "num_kv_blocks": 64,
        "max_num_batched_tokens": 32,
        "max_model_len": 256,
    }


async def _collect(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    stream = await engine.submit(EngineRequest(request_id, prompt, prompt, params))
    return [out async for out in stream]


def test_concurrent_requests_get_their_own_tokens(llama_dir: Path) -> None:
    offline = LLMEngine(EngineConfig.from_kwargs(**_settings(llama_dir)))
    for i, prompt in enumerate(PROMPTS):
        offline.add_request(prompt, GREEDY, request_id=str(i))
    expected = finish_all(offline)

    engine = start_engine(**_settings(llama_dir))
    try:

        async def main() -> list[list[RequestOutput]]:
            return await asyncio.gather(
                *(_collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS))
            )

        results = asyncio.run(main())
        for i, outputs in enumerate(results):
            assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
            assert outputs[-1].outputs[0].token_ids == expected[str(i)]
            # The deltas add up to the whole: nothing lost or repeated on the way across.
            assert [t for o in outputs for t in o.outputs[0].token_ids_delta] == expected[str(i)]
        state = wait_until_idle(engine)
        assert state.free_blocks == state.num_blocks
    finally:
        engine.shutdown()


def test_leaving_early_aborts_and_frees_blocks(llama_dir: Path) -> None:
    engine = start_engine(**_settings(llama_dir))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:

        async def main() -> None:
            stream = await engine.submit(EngineRequest("early", PROMPTS[0], PROMPTS[0], long))
            first = await stream.__anext__()
            assert not first.finished
            await stream.aclose()  # what a disconnecting client's cancellation amounts to

        asyncio.run(main())
        state = wait_until_idle(engine)
        assert (state.running, state.waiting, state.requests) == (0, 0, 0)
        assert state.free_blocks == state.num_blocks
        # The engine goes on serving.
        outputs = asyncio.run(_collect(engine, PROMPTS[1], GREEDY, "after"))
        assert outputs[-1].outputs[0].finish_reason == "length"
    finally:
        engine.shutdown()


def test_bad_request_fails_alone(llama_dir: Path) -> None:
    engine = start_engine(**_settings(llama_dir))
    try:

        async def main() -> None:
            with pytest.raises(InvalidRequestError):
                await _collect(engine, [10**9], GREEDY, "bad")  # outside the vocabulary
            good = await _collect(engine, PROMPTS[2], GREEDY, "good")
            assert good[-1].finished

        asyncio.run(main())
        assert engine.is_alive
    finally:
        engine.shutdown()


def test_failed_step_fails_every_request_and_later_ones(llama_dir: Path) -> None:
    engine = start_engine(**_settings(llama_dir))
    inner = engine.engine
    real_step = inner.step
    calls = {"n": 0}

    def faulty_step() -> list[RequestOutput]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step()

    inner.step = faulty_step  # type: ignore[method-assign]
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main() -> list[object]:
        return await asyncio.gather(
            *(_collect(engine, p, long, f"f{i}") for i, p in enumerate(PROMPTS[:3])),
            return_exceptions=True,
        )

    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(isinstance(r, EngineDeadError) and r.failed for r in results), results
    assert "injected fault" in str(results[0])
    assert not engine.is_alive and isinstance(engine.error, RuntimeError)

    async def later() -> None:
        with pytest.raises(EngineDeadError) as info:
            await _collect(engine, PROMPTS[0], GREEDY, "later")
        assert not info.value.failed

    asyncio.run(asyncio.wait_for(later(), 10))


def test_shutdown_aborts_requests_in_flight(llama_dir: Path) -> None:
    engine = start_engine(**_settings(llama_dir))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main() -> RequestOutput:
        stream = await engine.submit(EngineRequest("inflight", PROMPTS[0], PROMPTS[0], long))
        await stream.__anext__()  # running now
        threading.Thread(target=engine.shutdown).start()
        last = None
        async for out in stream:
            last = out
        assert last is not None
        return last

    last = asyncio.run(asyncio.wait_for(main(), 60))
    assert last.finished and last.outputs[0].finish_reason == "abort"
    engine.shutdown()
    assert not engine.is_alive and engine.error is None
    assert not engine.thread.is_alive()


def test_the_engine_is_built_on_the_thread_that_runs_it(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's CPU thread pool belongs to the thread that first computes: building the model on
    the main thread and stepping it on another halved the server's parallelism on 2 cores."""
    built_on = []
    original = LLMEngine.__init__

    def recording_init(self, config: EngineConfig) -> None:
        built_on.append(threading.current_thread())
        original(self, config)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=16, max_model_len=64)
    )
    try:
        assert built_on == [engine.thread] and engine.thread is not threading.main_thread()
        engine.start()

        async def one() -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            return (
                [
                    o
                    async for o in await engine.submit(
                        EngineRequest("r0", [5, 6, 7], [5, 6, 7], params)
                    )
                ][-1]
                .outputs[0]
                .token_ids
            )

        assert len(asyncio.run(one())) == 3
    finally:
        engine.shutdown()
    assert not engine.thread.is_alive()


def test_a_build_error_reaches_the_caller_and_an_unstarted_engine_shuts_down(
    llama_dir: Path, tmp_path: Path
) -> None:
    def engine_threads() -> int:
        return sum(t.name == "pagedserve-engine" for t in threading.enumerate())

    before = engine_threads()
    with pytest.raises(ModelLoadError):
        AsyncEngine.from_config(EngineConfig.from_kwargs(model=str(tmp_path / "missing")))
    assert engine_threads() == before  # the builder thread ended with its error
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=16, max_model_len=64)
    )
    engine.shutdown(timeout=5)  # never started: its thread must still end
    assert not engine.thread.is_alive()
    assert not engine.is_alive


def test_waiting_for_the_engine_thread_counts_as_queue_time(llama_dir: Path) -> None:
    """Arrival is when generate() hands the request over: a request that waits in the inbox
    while the engine thread is busy (here: not yet started) has been queued that long, and its
    TTFT and queue time say so, as a client measures them."""
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=16, max_model_len=64)
    )
    seen: list[EngineStats] = []
    engine.on_stats = seen.append
    held = 0.3
    try:

        async def main() -> list[RequestOutput]:
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            stream = await engine.submit(EngineRequest("held", [5, 6, 7], [5, 6, 7], params))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(held)  # the request sits in the inbox; the thread waits for start
            engine.start()
            return [await first, *[o async for o in stream]]

        outputs = asyncio.run(asyncio.wait_for(main(), 60))
        assert outputs[-1].finished
        wait_until_idle(engine)
    finally:
        engine.shutdown()
    ttfts = [t for s in seen for t in s.time_to_first_token]
    finished = [f for s in seen for f in s.finished]
    assert len(ttfts) == 1 and len(finished) == 1
    assert ttfts[0] >= held
    assert finished[0].queue_time is not None and finished[0].queue_time >= held
    assert finished[0].e2e_latency >= held


def test_a_request_that_cannot_be_added_fails_alone(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error while the engine thread adds one request (not a 400 the checks
    knew of) fails that request's stream, not the engine thread."""
    engine = start_engine(**_settings(llama_dir))
    add = LLMEngine.add_request

    def add_or_fail(self: LLMEngine, prompt: object, *args: object, **kwargs: object) -> str:
        if kwargs.get("prompt_token_ids") == PROMPTS[0]:
            raise KeyError("injected")
        return add(self, prompt, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LLMEngine, "add_request", add_or_fail)
    try:
        with pytest.raises(RequestFailedError, match="KeyError"):
            asyncio.run(_collect(engine, PROMPTS[0], GREEDY, "bad"))
        outputs = asyncio.run(_collect(engine, PROMPTS[1], GREEDY, "good"))
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10
        assert engine.is_alive
    finally:
        engine.shutdown()


def test_a_failing_stats_observer_does_not_stop_the_engine(llama_dir: Path) -> None:
    engine = start_engine(**_settings(llama_dir))
    calls = []

    def broken(stats: EngineStats) -> None:
        calls.append(stats)
        raise ValueError("a metrics bug")

    engine.on_stats = broken
    try:
        outputs = asyncio.run(_collect(engine, PROMPTS[1], GREEDY, "r"))
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 10
        assert calls and engine.is_alive
    finally:
        engine.shutdown()
