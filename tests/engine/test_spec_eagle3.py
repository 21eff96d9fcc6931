"""EAGLE-3 heads in vLLM's format: the target keeps the inputs to the head's layers (checked
against transformers' hidden states); the proposer's drafts are those of a plain-torch
reference of the EAGLE-3 math (no paging), after a prompt and after accepted and rejected
drafts; greedy outputs with a head equal those without; a head that does not fit the target
is refused naming 'model'."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from config import ConfigError, EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence
from engine.llm import LLM
from engine.loading.model_spec import resolve_model_spec
from engine.sampling_params import SamplingParams
from engine.spec_decode.eagle3 import Eagle3Proposer
from engine.spec_decode.eagle3_head import read_settings
from engine.stats import EngineStats
from engine.worker.executor import LocalExecutor
from engine.worker.model_input import build_step_batch
from tests.support.eagle3_heads import (
    AUX,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    SHARP,
    VOCAB,
    head_tensors,
    write_head,
)
from tests.support.models import build_random_model

BLOCK = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("target")
    return build_random_model(
        folder, "llama", "llama", vocab_size=VOCAB, initializer_range=SHARP, num_hidden_layers=4
    )


@pytest.fixture(scope="module")
def head() -> dict[str, torch.Tensor]:
    return head_tensors(seed=5)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, head: dict[str, torch.Tensor]) -> Path:
    return write_head(tmp_path_factory.mktemp("head"), head)


@pytest.fixture(scope="module")
def transformers_target(target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def engine_config_kwargs(target: Path, head: Path) -> dict[str, object]:
    return {
        "model": str(target),
        "dtype": "float32",
        "block_size": BLOCK,
        "num_kv_blocks": NUM_BLOCKS,
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    }


def engine_config(target: Path, head: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_config_kwargs(target, head))


# ------------------------------------------------------------------ the reference


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions[:, None].float() * inv[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    half = HEAD_DIM // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def head_rows(w: dict[str, torch.Tensor], embeds, hidden, positions):
    """The head over rows that attend causally to each other: (normed output, output)."""
    m = "midlayer."
    x = torch.cat(
        [rms(embeds, w[m + "input_layernorm.weight"]), rms(hidden, w[m + "hidden_norm.weight"])], -1
    )
    n = x.shape[0]
    q = rope((x @ w[m + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = rope((x @ w[m + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k = k.repeat_interleave(HEADS // KV_HEADS, 1)
    v = v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    h = attn @ w[m + "self_attn.o_proj.weight"].T + hidden
    g = rms(h, w[m + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(g @ w[m + "mlp.gate_proj.weight"].T)
    out = (act * (g @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T + h
    return rms(out, w["norm.weight"]), out


def aux_of(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' inputs to the layers AUX (its hidden_states[i] is layer i's input)."""
    with torch.no_grad():
        states = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in AUX], -1)


def reference_drafts(w, model, tokens: list[int], n: int) -> list[int]:
    """EAGLE-3 drafting from scratch: the row at position p pairs the target's hidden state
    at p with the token at p + 1; each draft feeds the head its own output. The head's own
    embedding if it has one, else the target's."""
    embedding = w.get("embed_tokens.weight", model.get_input_embeddings().weight)
    with torch.no_grad():
        hidden = aux_of(model, tokens[:-1]) @ w["fc.weight"].T
        row_tokens = list(tokens[1:])
        drafts = []
        for _ in range(n):
            positions = torch.arange(len(row_tokens))
            normed, out = head_rows(w, embedding[row_tokens], hidden, positions)
            best = int(torch.argmax(normed[-1] @ w["lm_head.weight"].T))
            drafts.append(best + int(w["d2t"][best]))
            row_tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


# ------------------------------------------------------------------ the engine by hand


class Harness:
    """The target's executor and the proposer over a KV manager; the scheduler's part is
    played by hand."""

    def __init__(self, target: Path, head: Path) -> None:
        config = engine_config(target, head)
        spec = resolve_model_spec(config)
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=False)
        self.executor = LocalExecutor(config, spec)
        self.executor.allocate_kv(NUM_BLOCKS)
        self.proposer = Eagle3Proposer(config, spec, self.executor, self.kv, NUM_BLOCKS)

    def target_step(self, runs: list[tuple[Sequence, list[int]]]) -> None:
        """The target computes each sequence's uncomputed tokens, then the drafts given."""
        scheduled = []
        for seq, drafts in runs:
            start = seq.num_computed_tokens
            count = seq.num_tokens - start + len(drafts)
            table = self.kv.allocate_slots(seq, count)
            assert table is not None
            scheduled.append(ScheduledSequence(seq, count, table, start, [seq], False, drafts))
        out = SchedulerOutput(scheduled)
        self.executor.execute(build_step_batch(out, BLOCK).host)
        self.proposer.observe(out)


def take(seq: Sequence, tokens: list[int]) -> None:
    """The step's verification took `tokens`; the last is sampled, not yet computed."""
    for token in tokens:
        seq.append_token(token)
    seq.num_computed_tokens = seq.num_tokens - 1


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(
        100, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_the_target_keeps_the_inputs_to_the_heads_layers(
    target_dir: Path, head_dir: Path, transformers_target
) -> None:
    harness = Harness(target_dir, head_dir)
    prompt = prompt_of(21, seed=1)
    seq = Sequence("a", "a", 0, prompt, SamplingParams(), 0.0)
    harness.target_step([(seq, [])])
    torch.testing.assert_close(
        harness.executor.aux_hidden(), aux_of(transformers_target, prompt), atol=1e-4, rtol=1e-4
    )


def test_drafts_follow_the_eagle3_math(
    target_dir: Path, head_dir: Path, head: dict[str, torch.Tensor], transformers_target
) -> None:
    harness = Harness(target_dir, head_dir)
    seqs = [
        Sequence(str(i), str(i), 0, prompt_of(n, seed=10 + i), SamplingParams(), 0.0)
        for i, n in enumerate([5, BLOCK, 40])
    ]
    harness.target_step([(seq, []) for seq in seqs])
    for i, seq in enumerate(seqs):
        take(seq, [300 + i])
    expect = lambda seq, n: reference_drafts(head, transformers_target, seq.all_token_ids, n)  # noqa: E731
    drafts = harness.proposer.propose(seqs, [3, 3, 2])
    assert drafts == [expect(seq, n) for seq, n in zip(seqs, [3, 3, 2])]
    # The target verifies them: all taken, one taken then a token of its own, none taken.
    harness.target_step([(seq, d) for seq, d in zip(seqs, drafts)])
    take(seqs[0], [*drafts[0], 900])
    take(seqs[1], [drafts[1][0], drafts[1][1] + 1])
    take(seqs[2], [drafts[2][0] + 1])
    for _ in range(2):  # the head's K/V where its own drafts put it is rewritten
        drafts = harness.proposer.propose(seqs, [3, 3, 3])
        assert drafts == [expect(seq, 3) for seq in seqs]
        harness.target_step([(seq, d) for seq, d in zip(seqs, drafts)])
        for seq, d in zip(seqs, drafts):
            take(seq, [d[0], d[1] + 1])


def test_a_head_with_its_own_embedding_reads_it(
    tmp_path: Path, target_dir: Path, transformers_target
) -> None:
    tensors = head_tensors(seed=7)
    tensors["embed_tokens.weight"] = torch.randn(
        VOCAB, HIDDEN, generator=torch.Generator().manual_seed(8)
    )
    harness = Harness(target_dir, write_head(tmp_path / "head", tensors))
    seq = Sequence("a", "a", 0, prompt_of(30, seed=3), SamplingParams(), 0.0)
    harness.target_step([(seq, [])])
    take(seq, [777])
    drafts = harness.proposer.propose([seq], [3])
    assert drafts == [reference_drafts(tensors, transformers_target, seq.all_token_ids, 3)]


SHARED = prompt_of(20, seed=19)  # a prefix the cache serves to the later prompts
E2E_PROMPTS = [SHARED[:3], SHARED + prompt_of(7, 21), SHARED + prompt_of(30, 22), prompt_of(90, 23)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def e2e_tokens(
    target: Path, num_blocks: int, caching: bool, head: Path | None
) -> tuple[list[list[int]], EngineStats]:
    """Greedy tokens of the prompts above, and the run's stats."""
    llm = LLM(
        model=str(target),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=caching,
        max_model_len=144,
        max_num_batched_tokens=48,  # the long prompts take several steps
        speculative_config=None
        if head is None
        else {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
    )
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in E2E_PROMPTS], GREEDY)
        return [o.outputs[0].token_ids for o in got], llm.last_run_stats
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def plain_tokens(target_dir: Path) -> list[list[int]]:
    """Without a head, once: greedy tokens depend on neither the pool nor the prefix cache."""
    return e2e_tokens(target_dir, NUM_BLOCKS, False, None)[0]


@pytest.mark.parametrize(
    ("num_blocks", "caching"),
    [
        (NUM_BLOCKS, False),
        (10, True),  # 160 slots for four sequences of up to 114 tokens: preemption, recompute
    ],
)
def test_greedy_outputs_are_the_targets_own(
    target_dir: Path, head_dir: Path, plain_tokens: list[list[int]], num_blocks: int, caching: bool
) -> None:
    tokens, stats = e2e_tokens(target_dir, num_blocks, caching, head_dir)
    assert tokens == plain_tokens
    # The head drafted: its drafts were verified.
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    assert (stats.num_preemptions > 0) == (num_blocks < NUM_BLOCKS)


def test_tensor_parallelism_is_refused_naming_model(target_dir: Path, head_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"'model'.*--tensor-parallel-size"):
        LLM(**engine_config_kwargs(target_dir, head_dir), tensor_parallel_size=2)


def test_default_layers_are_vllms(tmp_path: Path, head: dict[str, torch.Tensor]) -> None:
    folder = write_head(tmp_path / "head", head, eagle_config={})
    assert read_settings(folder, 32).aux_layers == (2, 16, 29)


@pytest.mark.parametrize(
    ("tensors", "config", "why"),
    [
        ("narrow", {}, "checkpoint shape"),  # weights of a 48-wide head under a 64-wide config
        ("ok", {"target_hidden_size": 48}, "hidden states of 48"),
        ("ok", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "layers"),
        ("ok", {"vocab_size": 1000}, "vocabulary"),
        ("ok", {"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_naming_model(
    tmp_path: Path, target_dir: Path, tensors: str, config: dict, why: str
) -> None:
    weights = head_tensors(seed=6, hidden=48) if tensors == "narrow" else head_tensors(seed=6)
    folder = write_head(tmp_path / "head", weights, **config)
    with pytest.raises(ConfigError, match="'model'") as info:
        LLM(**engine_config_kwargs(target_dir, folder))
    assert why in str(info.value)


def test_a_target_that_frees_blocks_behind_a_window_is_refused(
    tmp_path: Path, head_dir: Path
) -> None:
    target = build_random_model(
        tmp_path / "mistral", "mistral", "llama", vocab_size=VOCAB, sliding_window=64
    )
    with pytest.raises(ConfigError, match="'model'") as info:
        LLM(**engine_config_kwargs(target, head_dir))
    assert "sliding window" in str(info.value)
