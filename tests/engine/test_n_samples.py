"""n > 1 samples per request: siblings fork from the prompt's blocks and copy on write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.scheduler import SchedulerOutput
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.support.models import hf_greedy

BLOCK = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm(small_vocab_qwen3_dir: Path) -> LLM:
    return LLM(
        model=str(small_vocab_qwen3_dir),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=256,
        max_num_seqs=8,
    )


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        100, 5000, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.pool.num_free == NUM_BLOCKS
    assert not any(kv.tables.values())
    kv.check_consistency()


def test_greedy_samples_all_equal_the_single_greedy_output(
    llm: LLM, small_vocab_qwen3_dir: Path
) -> None:
    prompt = random_prompt(2 * BLOCK + 5, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (single,) = llm.generate(prompt, greedy)
    (multi,) = llm.generate(
        prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    )

    expected = hf_greedy(small_vocab_qwen3_dir, [prompt], 8)[0]
    assert single.outputs[0].token_ids == expected
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    for out in multi.outputs:
        assert out.token_ids == expected
        assert out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_siblings_share_full_blocks_and_copy_the_partial_one(llm: LLM) -> None:
    engine = llm.engine
    kv = engine.kv
    outputs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        outputs.append(out)
        return out

    # 21 prompt tokens: one full block and a partial one, both shared by the 3 siblings.
    prompt = random_prompt(BLOCK + 5, seed=2)
    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    try:
        request_id = engine.add_request(
            prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
        )
        ids = [request_id, f"{request_id}#1", f"{request_id}#2"]
        engine.step()
        tables = [kv.tables[i] for i in ids]
        assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 2
        full, partial = tables[0]
        assert kv.pool.ref_cnt[full] == 3
        assert kv.pool.ref_cnt[partial] == 3
        assert outputs[-1].block_copies == []

        # The first decode step writes into the shared partial block: the first two writers
        # copy it, the last one is then its only holder and writes in place.
        engine.step()
        copies = outputs[-1].block_copies
        assert [src for src, _ in copies] == [partial, partial]
        privates = [dst for _, dst in copies]
        assert [kv.tables[i][1] for i in ids] == [*privates, partial]
        assert len({partial, *privates}) == 3 and full not in privates
        assert all(kv.pool.ref_cnt[b] == 1 for b in (partial, *privates))

        final: RequestOutput | None = None
        while engine.has_unfinished_requests():
            running = [i for i in ids if kv.tables.get(i)]
            if running:
                # The full prompt block stays shared by every sibling still running.
                assert kv.pool.ref_cnt[full] == len(running)
                assert all(kv.tables[i][0] == full for i in running)
            for out in engine.step():
                final = out
        # No more copies after the first divergence: every later write is to a private block.
        assert all(out.block_copies == [] for out in outputs[2:])
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    assert final is not None and final.finished
    assert len({tuple(o.token_ids) for o in final.outputs}) == 1
    assert_all_blocks_free(llm)


def test_seeded_samples_use_consecutive_seeds(llm: LLM) -> None:
    prompt = random_prompt(BLOCK + 3, seed=3)
    (pair,) = llm.generate(
        prompt, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    )
    singles = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
            for seed in (7, 8)
        ],
    )
    samples = [o.token_ids for o in pair.outputs]
    # The two samples differ, so the comparison below tells the seeds apart.
    assert samples[0] != samples[1]
    assert samples == [s.outputs[0].token_ids for s in singles]
    assert_all_blocks_free(llm)
