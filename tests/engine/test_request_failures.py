"""A request that fails inside a step (sampling its row, the work the step's rows share, taking
its token, making its text or its output, a beam search's scoring) ends alone: its output says
finish_reason "error" and why, its blocks go back to the pool, and every other request finishes
with exactly the tokens it has alone. The failures are injected by wrapping the engine's own
functions so that they raise for one request only, from its third token on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import engine.core.scheduler as scheduler_module
import engine.llm_engine as llm_engine_module
import engine.worker.sampler as sampler_module
from config import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.core.beam_search import BeamGroup
from engine.core.sequence import Sequence
from engine.outputs import RequestOutput
from engine.structured import StructuredOutputsParams
from engine.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Sampled (so its row is sampled alone, not with the argmax rows), seeded: reproducible.
SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
BEAMS = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=10, ignore_eos=True)
OTHERS = {
    "a": (list(range(100, 140)), GREEDY),
    "b": (
        list(range(300, 333)),
        SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True),
    ),
    "c": (list(range(600, 620)), SAMPLED),
}
VICTIM_PROMPT = list(range(500, 510))
FAIL_FROM = 2  # output tokens the victim has when its failure strikes


class Injected(RuntimeError):
    pass


def _is_victim(seq: Sequence) -> bool:
    return seq.request_id == "victim" and seq.num_output_tokens >= FAIL_FROM


def _raising_for_victim(original: Callable[..., Any], seq_of: Callable[..., Sequence]):
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _is_victim(seq_of(*args, **kwargs)):
            raise Injected("injected")
        return original(*args, **kwargs)

    return wrapped


def _inject(stage: str, monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """Make `stage` raise for the victim; the victim's sampling parameters for that stage."""
    if stage == "sample_row":  # its own row's sampling
        original = Sampler._sample_row
        monkeypatch.setattr(
            Sampler, "_sample_row", _raising_for_victim(original, lambda _self, _row, seq: seq)
        )
        return SAMPLED
    if stage == "shared":  # the rows' shared work (grammar masks): each row is sampled alone
        masks = sampler_module.apply_grammar_masks

        def masks_or_fail(logits: Any, grammars: list) -> None:
            if any(g is not None for g in grammars):  # only the victim has a grammar
                raise Injected("injected")
            masks(logits, grammars)

        monkeypatch.setattr(sampler_module, "apply_grammar_masks", masks_or_fail)
        return dataclasses.replace(
            SAMPLED, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")
        )
    if stage == "token":  # taking its token (stop checks, its grammar)
        stop = scheduler_module.check_stop
        monkeypatch.setattr(
            scheduler_module, "check_stop", _raising_for_victim(stop, lambda seq, *_: seq)
        )
        return GREEDY
    if stage == "text":  # detokenizing, stop strings
        update = llm_engine_module.update_texts
        monkeypatch.setattr(
            llm_engine_module, "update_texts", _raising_for_victim(update, lambda seq, *_: seq)
        )
        return GREEDY
    if stage == "output":  # making its output
        make = llm_engine_module.make_output
        monkeypatch.setattr(
            llm_engine_module,
            "make_output",
            _raising_for_victim(make, lambda request: request.sequences[0]),
        )
        return GREEDY
    assert stage == "beam_scoring"
    advance = BeamGroup.advance

    def advance_or_fail(group: BeamGroup, scheduler: Any) -> None:
        if group.root.request_id == "victim" and group.num_generated >= FAIL_FROM:
            raise OverflowError("injected")
        advance(group, scheduler)

    monkeypatch.setattr(BeamGroup, "advance", advance_or_fail)
    return BEAMS


def _engine(folder: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=str(folder),
            max_num_batched_tokens=32,
            block_size=4,
            num_kv_blocks=128,
            max_model_len=128,
        )
    )


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    finals: dict[str, RequestOutput] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert isinstance(out, RequestOutput)
                finals[out.request_id] = out
    return finals


@pytest.fixture(scope="module")
def engine(qwen2_dir: Path) -> LLMEngine:
    """One engine for the module: each test leaves it idle with every block free (and checks
    so), which is all the next one needs, and building one costs more than a test's requests."""
    return _engine(qwen2_dir)


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Each other request's tokens (every sample's), run by itself."""
    tokens = {}
    for rid, request in OTHERS.items():
        (out,) = _run(engine, {rid: request}).values()
        tokens[rid] = [c.token_ids for c in out.outputs]
    return tokens


@pytest.mark.parametrize(
    "stage", ["sample_row", "shared", "token", "text", "output", "beam_scoring"]
)
def test_a_failing_request_ends_alone_and_the_others_finish_exact(
    stage: str, engine: LLMEngine, alone: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.take_stats()  # what the module's earlier requests left counted
    victim = _inject(stage, monkeypatch)
    finals = _run(engine, {**OTHERS, "victim": (VICTIM_PROMPT, victim)})

    failed = finals.pop("victim")
    assert failed.finished and failed.error is not None
    assert "Injected" in failed.error or "OverflowError" in failed.error
    assert failed.outputs and {c.finish_reason for c in failed.outputs} == {"error"}
    assert {rid: [c.token_ids for c in out.outputs] for rid, out in finals.items()} == alone
    assert all(c.finish_reason == "length" for out in finals.values() for c in out.outputs)

    # Nothing of the victim is left: no sequence, no block; its end is counted as an error.
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    engine.kv.check_consistency()
    reasons = sorted(done.finish_reason for done in engine.take_stats().finished)
    assert reasons == ["error", "length", "length", "length"]

    # The engine goes on: the next request is served as it would be alone.
    monkeypatch.undo()
    (again,) = _run(engine, {"a": OTHERS["a"]}).values()
    assert [c.token_ids for c in again.outputs] == alone["a"]


def test_without_a_failure_nothing_is_reported(engine: LLMEngine, alone: dict) -> None:
    finals = _run(engine, {**OTHERS, "victim": (VICTIM_PROMPT, GREEDY)})
    assert all(out.error is None for out in finals.values())
    assert {rid: [c.token_ids for c in finals[rid].outputs] for rid in OTHERS} == alone
