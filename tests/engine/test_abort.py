"""Aborting a request mid-flight frees its blocks and leaves the others untouched."""

from __future__ import annotations

from pathlib import Path

from config import EngineConfig
from engine import LLMEngine, SamplingParams
from tests.support.models import finish_all

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_abort_frees_blocks_and_spares_other_requests(qwen2_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(qwen2_dir), max_num_batched_tokens=16))
    prompts = {"a": list(range(100, 140)), "b": list(range(300, 333)), "c": list(range(500, 510))}
    alone = {}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id=rid)
        alone.update(finish_all(engine))

    for rid, prompt in prompts.items():
        engine.add_request(
            prompt,
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2 if rid == "b" else 1),
            request_id=rid,
        )
    for _ in range(
        4
    ):  # "b" is mid-prefill or early in decode, its n=2 sibling maybe not forked yet
        engine.step()
    aborted = engine.abort_request("b")
    assert aborted is not None and aborted.finished
    assert [o.finish_reason for o in aborted.outputs] == ["abort", "abort"]
    assert engine.abort_request("b") is None  # unknown by now
    final = finish_all(engine)

    assert set(final) == {"a", "c"}
    assert final["a"] == alone["a"] and final["c"] == alone["c"]
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    engine.kv.check_consistency()
