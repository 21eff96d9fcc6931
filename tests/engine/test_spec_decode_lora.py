"""Speculative decoding against transformers + peft, float32: rows under two LoRA adapters and
the base model in one batch, served by priority, chunked, preempted and prefix-cached, with
drafts that are mostly the reference's own tokens (and some wrong): every request gets exactly
the reference's greedy tokens, and most drafts are accepted (so the drafted rows ran under each
request's adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import LLM, LoRARequest, SamplingParams
from engine.core.sequence import Sequence
from tests.support.lora import ALL_TARGETS, make_adapter, peft_greedy
from tests.support.prompts import cut_prompts

MAX_NEW = 14
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [3, 19, 41]
Key = tuple[tuple[int, ...], str | None]


class ReferenceProposer:
    """Drafts from the reference's tokens for the sequence's prompt and adapter; every fourth
    proposal's first token made wrong."""

    def __init__(self, references: dict[Key, list[int]]) -> None:
        self.references = references
        self.calls = 0

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, max_drafts):
            key = (tuple(seq.prompt_token_ids), None if seq.lora is None else seq.lora.lora_name)
            done = seq.num_output_tokens
            draft = list(self.references[key][done : done + k])
            self.calls += 1
            if self.calls % 4 == 0 and draft:
                draft[0] = (draft[0] + 1) % 1000
            drafts.append(draft)
        return drafts

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora-spec")
    a = make_adapter(llama_dir, root / "a", rank=8, alpha=16, targets=ALL_TARGETS, seed=1)
    b = make_adapter(llama_dir, root / "b", rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=2)
    return {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}


def test_drafted_rows_run_under_each_request_adapter(
    llama_dir: Path, adapters: dict[str, LoRARequest]
) -> None:
    prompts = cut_prompts(AutoTokenizer.from_pretrained(llama_dir), LENGTHS)
    references: dict[Key, list[int]] = {}
    for name in (None, "a", "b"):
        path = None if name is None else Path(adapters[name].lora_path)
        for prompt, tokens in zip(prompts, peft_greedy(llama_dir, path, prompts, MAX_NEW)):
            references[(tuple(prompt), name)] = tokens
    batch = [(p, name) for name in (None, "a", "b") for p in prompts]
    with LLM(
        str(llama_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_kv_blocks=14,
        block_size=8,
        max_model_len=64,
        max_num_seqs=9,
        scheduling_policy="priority",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    ) as llm:
        speculator = llm.engine.speculator
        assert speculator is not None
        speculator.proposer = ReferenceProposer(references)
        outputs = llm.generate(
            [p for p, _ in batch],
            GREEDY,
            priority=[i % 3 - 1 for i in range(len(batch))],
            lora_request=[None if n is None else adapters[n] for _, n in batch],
        )
        stats = llm.last_run_stats
        kv = llm.engine.kv
        assert kv.pool.num_free == kv.pool.num_blocks
    for (prompt, name), out in zip(batch, outputs, strict=True):
        assert out.outputs[0].token_ids == references[(tuple(prompt), name)], name
    assert stats.num_preemptions > 0
    drafts = stats.spec_decode
    assert drafts.num_accepted_tokens > drafts.num_draft_tokens / 2
    assert drafts.num_accepted_tokens < drafts.num_draft_tokens
