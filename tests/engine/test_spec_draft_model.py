"""The draft-model proposer: its drafts are the draft model's own greedy continuation (the
oracle: transformers' greedy generate on the draft), after any mix of accepted and rejected
drafts, preemptions and prompts longer than a step; its K/V lives in the target's blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config import ConfigError, EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sequence import Sequence
from engine.llm import LLM
from engine.loading.model_spec import ModelSpec, resolve_model_spec
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_model import DraftModelProposer, draft_kv_bytes_per_block
from tests.support.models import build_random_model, greedy_of

BLOCK = 16
NUM_BLOCKS = 64
VOCAB = 4096  # the Llama-3.2 tokenizer's first ids: small embeddings, fast tests
STEP_TOKENS = 32  # a step's token budget: the long prompts below take several draft batches
# Weights large enough that the next token depends on the whole context: at transformers'
# default (0.02) a one-layer model's attention is near uniform, and K/V read from the wrong
# positions would often still give the right greedy tokens.
SHARP = 0.2
# The draft: half the target's width, one layer, one KV head of 16 dims.
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}

# Engines through LLM(...): a pool that preempts and a budget that chunks.
E2E_BLOCKS = 16  # 256 tokens for 8 sequences of up to 88
E2E = {
    "block_size": BLOCK,
    "num_kv_blocks": E2E_BLOCKS,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 48,
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("target")
    return build_random_model(folder, "llama", "llama", vocab_size=VOCAB, initializer_range=SHARP)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("draft")
    return build_random_model(
        folder, "llama", "llama", seed=1, vocab_size=VOCAB, initializer_range=SHARP, **SMALL
    )


def engine_config(target: Path, draft: Path | str) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(target),
        block_size=BLOCK,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=256,
        max_num_batched_tokens=STEP_TOKENS,
        max_num_seqs=8,
        speculative_config={"model": str(draft), "num_speculative_tokens": 4},
    )


class Harness:
    """A proposer over a KV manager, with the engine's part played by hand: the target's
    steps are simulated by appending tokens and advancing `num_computed_tokens`."""

    def __init__(self, target: Path, draft: Path) -> None:
        config = engine_config(target, draft)
        self.spec: ModelSpec = resolve_model_spec(config)
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
        self.proposer = DraftModelProposer(config, self.spec, self.kv, NUM_BLOCKS)
        self._ids = 0

    def prefilled(self, prompt: list[int], first_token: int) -> Sequence:
        """A sequence whose prompt the target computed and whose first token it sampled."""
        self._ids += 1
        seq = Sequence(str(self._ids), str(self._ids), 0, prompt, SamplingParams(), 0.0)
        assert self.kv.allocate_slots(seq, len(prompt)) is not None
        seq.num_computed_tokens = len(prompt)
        seq.append_token(first_token)
        return seq

    def free_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.kv.free(seq)
        assert self.kv.pool.num_free == NUM_BLOCKS
        self.kv.check_consistency()


def verified(seq: Sequence, accepted: list[int], bonus: int) -> None:
    """The target's verify step: the accepted drafts and one token of its own are taken; the
    sequence's last token is the only one not computed."""
    for token in [*accepted, bonus]:
        seq.append_token(token)
    seq.num_computed_tokens = seq.num_tokens - 1


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, VOCAB, (length,), generator=generator).tolist()


def other_than(token: int) -> int:
    return 100 + (token + 1) % (VOCAB - 100)


@pytest.fixture(scope="module")
def draft_greedy(draft_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    return lambda ids, n: greedy_of(model, [ids], n)[0]


@pytest.fixture(scope="module")
def harness(target_dir: Path, draft_dir: Path) -> Harness:
    return Harness(target_dir, draft_dir)


def test_drafts_are_the_draft_models_greedy_continuation(harness: Harness, draft_greedy) -> None:
    seqs = [
        harness.prefilled(prompt_of(5, seed=1), 300),
        harness.prefilled(prompt_of(BLOCK, seed=2), 301),  # the last token opens a block
        harness.prefilled(prompt_of(3 * STEP_TOKENS + 7, seed=3), 302),  # over several batches
    ]
    wanted = [4, 1, 3]
    drafts = harness.proposer.propose(seqs, wanted)
    for seq, n, got in zip(seqs, wanted, drafts, strict=True):
        assert got == draft_greedy(seq.all_token_ids, n)
    harness.free_all(seqs)


def test_catch_up_after_accepted_and_rejected_drafts(harness: Harness, draft_greedy) -> None:
    seqs = [harness.prefilled(prompt_of(9 + i, seed=10 + i), 400 + i) for i in range(3)]
    drafts = harness.proposer.propose(seqs, [4, 4, 4])
    # All accepted, two then a rejection, none: the rejected drafts' K/V must not be read.
    verified(seqs[0], drafts[0], 500)
    verified(seqs[1], drafts[1][:2], other_than(drafts[1][2]))
    verified(seqs[2], [], other_than(drafts[2][0]))
    for _ in range(3):  # and on, each step accepting one
        drafts = harness.proposer.propose(seqs, [4, 3, 2])
        for seq, n, got in zip(seqs, [4, 3, 2], drafts, strict=True):
            assert got == draft_greedy(seq.all_token_ids, n)
            verified(seq, got[:1], other_than(got[1]))
    harness.free_all(seqs)


def test_steps_without_drafts_between_proposals(harness: Harness, draft_greedy) -> None:
    """Only the drafts the sequence took have valid K/V, whatever ran in between (a step
    with too many sequences to speculate proposes nothing)."""
    seqs = [harness.prefilled(prompt_of(11 + i, seed=15 + i), 450) for i in range(2)]
    drafts = harness.proposer.propose(seqs, [4, 4])
    verified(seqs[0], [], other_than(drafts[0][0]))  # then tokens the drafts did not guess
    verified(seqs[0], [], other_than(drafts[0][1]))
    verified(seqs[1], drafts[1][:1], other_than(drafts[1][1]))  # one taken, then others
    verified(seqs[1], [], drafts[1][2])
    for seq, got in zip(seqs, harness.proposer.propose(seqs, [3, 3]), strict=True):
        assert got == draft_greedy(seq.all_token_ids, 3)
    harness.free_all(seqs)


def test_a_preempted_sequence_is_run_again_from_its_start(harness: Harness, draft_greedy) -> None:
    seq = harness.prefilled(prompt_of(2 * BLOCK + 3, seed=20), 600)
    harness.proposer.propose([seq], [3])
    verified(seq, [], 601)
    before = list(harness.kv.block_table(seq))
    # Preempted and recomputed into other blocks: what the draft wrote before is gone.
    harness.kv.free(seq)
    seq.num_preemptions += 1
    seq.num_computed_tokens = 0
    hog = harness.prefilled(prompt_of(4 * BLOCK, seed=21), 602)
    assert harness.kv.allocate_slots(seq, seq.num_tokens - 1) is not None
    seq.num_computed_tokens = seq.num_tokens - 1
    assert harness.kv.block_table(seq)[:3] != before[:3]
    (drafts,) = harness.proposer.propose([seq], [3])
    assert drafts == draft_greedy(seq.all_token_ids, 3)
    harness.free_all([seq, hog])


def test_draft_kv_is_written_only_into_the_sequences_blocks(harness: Harness) -> None:
    assert harness.proposer.executor is not None
    cache = harness.proposer.executor.runner.kv_caches
    for keys, values in cache:  # what earlier tests wrote
        keys.zero_()
        values.zero_()
    seq = harness.prefilled(prompt_of(2 * BLOCK + 5, seed=30), 700)
    harness.proposer.propose([seq], [4])
    table = harness.kv.block_table(seq)
    # The verify step's positions are reserved: the last token and four drafts.
    assert len(table) == -(-(seq.num_tokens + 4) // BLOCK)
    keys = cache[0][0]
    written = {b for b in range(NUM_BLOCKS) if keys[b].abs().sum() > 0}
    assert written == set(table)
    # Positions past the last draft fed (num_tokens + 2) hold nothing.
    last = seq.num_tokens + 2
    assert keys[table[last // BLOCK], last % BLOCK].abs().sum() > 0
    after = last + 1
    assert keys[table[after // BLOCK], after % BLOCK].abs().sum() == 0
    harness.free_all([seq])


def test_a_short_pool_leaves_that_sequence_without_drafts(harness: Harness, draft_greedy) -> None:
    fits = harness.prefilled(prompt_of(7, seed=40), 800)  # room left in its block
    starved = harness.prefilled(prompt_of(BLOCK, seed=41), 801)  # needs a new block
    hog = Sequence("hog", "hog", 0, [1], SamplingParams(), 0.0)
    assert harness.kv.allocate_slots(hog, harness.kv.pool.num_free * BLOCK) is not None
    drafts = harness.proposer.propose([starved, fits], [4, 4])
    assert drafts == [[], draft_greedy(fits.all_token_ids, 4)]
    harness.free_all([fits, starved, hog])


def test_finished_sequences_are_forgotten(harness: Harness) -> None:
    seqs = [harness.prefilled(prompt_of(6, seed=50 + i), 900) for i in range(2)]
    harness.proposer.propose(seqs, [2, 2])
    assert {s.seq_id for s in seqs} <= set(harness.proposer.states)
    harness.proposer.propose(seqs[1:], [2])
    assert set(harness.proposer.states) == {seqs[1].seq_id}
    harness.free_all(seqs)


def test_the_target_as_its_own_draft_proposes_its_greedy_tokens(target_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    harness = Harness(target_dir, target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    prompt = prompt_of(BLOCK + 4, seed=60)
    expected = greedy_of(target, [prompt], 9)[0]
    seq = harness.prefilled(prompt, expected[0])
    got = []
    while len(got) < 8:  # every draft accepted, as verification would
        drafts = harness.proposer.propose([seq], [4])[0]
        got += drafts
        verified(seq, drafts[:-1], drafts[-1])
    assert got[:8] == expected[1:9]
    harness.free_all([seq])


def test_draft_kv_bytes_per_block_are_the_drafts(target_dir: Path, draft_dir: Path) -> None:
    config = engine_config(target_dir, draft_dir)
    # K and V, one layer, one KV head of 16 dims, 16 positions, float32.
    assert draft_kv_bytes_per_block(config, resolve_model_spec(config)) == 2 * 16 * 16 * 4


@pytest.mark.parametrize(
    ("tokenizer", "vocab", "why"),
    [
        ("qwen", VOCAB, "tokenizer differs"),  # the same size, other text per id
        ("llama", VOCAB // 2, "vocabulary has 2048 tokens"),
    ],
)
def test_a_draft_of_another_vocabulary_is_refused(
    target_dir: Path, tmp_path: Path, tokenizer: str, vocab: int, why: str
) -> None:
    draft = build_random_model(tmp_path, "llama", tokenizer, vocab_size=vocab, **SMALL)
    speculative = {"model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match=f"'model'.*{why}"):
        LLM(model=str(target_dir), speculative_config=speculative, **E2E)


def test_a_target_that_frees_blocks_behind_its_window_is_refused(
    tmp_path: Path, draft_dir: Path
) -> None:
    # Mistral's window (2048) is wider than the context: no block is ever freed behind it.
    wide = build_random_model(tmp_path / "mistral", "mistral", "llama", vocab_size=VOCAB)
    config = engine_config(wide, draft_dir)
    assert draft_kv_bytes_per_block(config, resolve_model_spec(config)) > 0
    narrow = build_random_model(tmp_path / "phi3", "phi3", "llama", vocab_size=VOCAB)  # 27
    config = engine_config(narrow, draft_dir)
    with pytest.raises(ConfigError, match=r"'model'.*sliding window"):
        draft_kv_bytes_per_block(config, resolve_model_spec(config))


def test_a_draft_that_cannot_load_is_refused(target_dir: Path, tmp_path: Path) -> None:
    config = engine_config(target_dir, tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"'model'.*cannot load"):
        draft_kv_bytes_per_block(config, resolve_model_spec(config))


def greedy_run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    kv = llm.engine.kv
    assert kv.pool.num_free == E2E_BLOCKS
    kv.check_consistency()
    return outputs


@pytest.fixture(scope="module")
def e2e_prompts() -> list[list[int]]:
    return [prompt_of(n, seed=70 + n) for n in (5, 17, 33, 48, 9, 64, 26, 40)]


@pytest.fixture(scope="module")
def plain_tokens(target_dir: Path, e2e_prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(target_dir), **E2E)
    try:
        return greedy_run(llm, e2e_prompts)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("draft", ["target", "small"])
def test_speculating_engine_gives_the_greedy_tokens(
    draft: str,
    target_dir: Path,
    draft_dir: Path,
    e2e_prompts: list[list[int]],
    plain_tokens: list[list[int]],
) -> None:
    folder = target_dir if draft == "target" else draft_dir
    speculative = {"model": str(folder), "num_speculative_tokens": 3}
    llm = LLM(model=str(target_dir), speculative_config=speculative, **E2E)
    try:
        assert greedy_run(llm, e2e_prompts) == plain_tokens
        stats = llm.last_run_stats
    finally:
        llm.engine.close()
    drafts = stats.spec_decode
    assert stats.num_preemptions > 0  # the pool was short: drafts survived recomputation
    assert drafts.num_draft_tokens > 0
    if draft == "target":  # the target guesses itself: every draft is accepted
        assert drafts.num_accepted_tokens == drafts.num_draft_tokens
    else:
        assert drafts.num_accepted_tokens < drafts.num_draft_tokens
