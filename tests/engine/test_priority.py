"""Priority scheduling through the engine: refused on a first-come engine, and on a priority
engine the most urgent request runs first while every request's tokens stay what they would be
alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The weather today is", "Once upon a time", "My favourite food is", "In the city"]


def test_a_first_come_engine_refuses_a_priority(qwen2_dir: Path) -> None:
    with LLM(str(qwen2_dir), num_kv_blocks=16, max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError) as refused:
            llm.generate(PROMPTS[:2], GREEDY, priority=[0, 1])
        assert refused.value.param == "priority"
        assert "--scheduling-policy priority" in str(refused.value)
        assert not llm.engine.has_unfinished_requests()  # nothing of the call was queued
        assert llm.generate(PROMPTS[:2], GREEDY, priority=[0, 0])[0].finished


def test_the_most_urgent_request_runs_first_with_unchanged_tokens(qwen2_dir: Path) -> None:
    with LLM(
        str(qwen2_dir),
        num_kv_blocks=32,
        max_model_len=64,
        max_num_seqs=1,
        scheduling_policy="priority",
    ) as llm:
        alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        engine = llm.engine
        ids = [
            engine.add_request(p, GREEDY, priority=rank) for p, rank in zip(PROMPTS, [3, -1, 2, -1])
        ]
        finished, tokens = [], {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
                    tokens[out.request_id] = out.outputs[0].token_ids
        assert finished == [ids[1], ids[3], ids[2], ids[0]]  # -1, -1 (in arrival order), 2, 3
        assert [tokens[i] for i in ids] == alone
