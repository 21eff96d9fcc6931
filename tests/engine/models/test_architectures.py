"""Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE against transformers (random weights,
float32): greedy tokens equal `generate`'s, and the chosen tokens' logprobs equal those of one
teacher-forced transformers forward over prompt and continuation. Greedy tokens of a tiny random
model barely depend on attention; the logprobs do, so a wrong window, soft-cap or rotary table
shows there.

Every regime the engine has: plain batching, prompts chunked over many steps, a pool small
enough to preempt, prefix caching, tensor parallelism on two gloo ranks. The prompts (up to 320
tokens) are far longer than the models' windows (19 to 27 tokens), so windowed layers really
slide; Mixtral's router has two identical rows, so routing ties are broken as transformers
breaks them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.distributed.shard import check_shardable
from engine.errors import ModelLoadError
from engine.loading.resolve import load_hf_config
from engine.models.registry import describe
from tests.support.models import build_random_model, folder_tokenizer, greedy_batched_of
from tests.support.prompts import cut_prompts, shared_prefix_prompts

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
ARCHITECTURES = {  # architecture -> (tokenizer, config overrides)
    "gemma2": ("llama", {}),
    "gemma3": ("qwen", {}),
    "phi3": ("llama", {}),
    "mixtral": ("llama", {}),
    "qwen3_moe": ("qwen", {}),
    # Every layer windowed: blocks behind the window go back to the pool.
    "mistral": ("llama", {"sliding_window": 21}),
}
REGIMES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempt": {"num_kv_blocks": 32, "block_size": 16, "max_model_len": 384},
    "prefix_cache": {"enable_prefix_caching": True},
}


def tie_router_rows(folder: Path) -> None:
    """Experts 1 and 2 of every layer get the same router row (their own weights differ), so
    every token scores them equally and a top-2 pick must break the tie."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            t[2] = t[1]
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch_dir(request, tmp_path_factory) -> Path:
    arch = request.param
    tokenizer, overrides = ARCHITECTURES[arch]
    folder = build_random_model(tmp_path_factory.mktemp(arch), arch, tokenizer, **overrides)
    if arch == "mixtral":
        tie_router_rows(folder)
    return folder


_oracle: dict[tuple[Path, str], tuple[list[list[int]], list[list[int]], list[list[float]]]] = {}


def oracle(folder: Path, prompt_set: str):
    """(prompts, transformers' greedy tokens, the logprob of each of those tokens)."""
    key = (folder, prompt_set)
    if key not in _oracle:
        tok = folder_tokenizer(folder)
        prompts = cut_prompts(tok) if prompt_set == "varied" else shared_prefix_prompts(tok)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        # One left-padded batch: the same tokens as one prompt at a time for every model here.
        tokens = greedy_batched_of(model, prompts, MAX_NEW)
        logprobs = []
        for prompt, out in zip(prompts, tokens):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0].float()
            rows = logits[len(prompt) - 1 : -1].log_softmax(-1)
            logprobs.append(rows.gather(1, torch.tensor(out)[:, None]).squeeze(1).tolist())
        _oracle[key] = (prompts, tokens, logprobs)
    return _oracle[key]


def generate(folder: Path, prompts: list[list[int]], **kwargs):
    # Phi-3's LongRoPE takes its short factors only when the served context fits the original
    # 512 positions, as transformers does for sequences that short.
    kwargs.setdefault("max_model_len", 512)
    with LLM(str(folder), max_num_seqs=8, **kwargs) as llm:
        outputs = llm.generate(prompts, GREEDY)
        kv, stats = llm.engine.kv, llm.last_run_stats
        assert kv.pool.num_free == kv.pool.num_blocks  # every block back in the pool
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
    ]
    return tokens, logprobs, stats


def check(got_tokens, got_logprobs, want_tokens, want_logprobs) -> None:
    assert len(got_tokens) == len(want_tokens) and len(got_logprobs) == len(want_logprobs)
    for i, (g, w) in enumerate(zip(got_tokens, want_tokens)):
        assert g == w, f"prompt {i}: tokens {g} != {w}"
    for g, w in zip(got_logprobs, want_logprobs):
        assert g == pytest.approx(w, abs=2e-4)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_equals_transformers(arch_dir: Path, regime: str) -> None:
    prompt_set = "shared" if regime == "prefix_cache" else "varied"
    prompts, want_tokens, want_logprobs = oracle(arch_dir, prompt_set)
    tokens, logprobs, stats = generate(arch_dir, prompts, **REGIMES[regime])
    check(tokens, logprobs, want_tokens, want_logprobs)
    windowed_everywhere = None not in describe(load_hf_config(arch_dir)).sliding_windows
    if regime == "preempt" and not windowed_everywhere:
        # A model windowed in every layer gives its blocks back as it goes, so this pool is
        # not short for it (the test below shows what it holds instead).
        assert stats.num_preemptions > 0
    if regime == "prefix_cache":
        assert stats.prefix_cache_hits > 0


def test_torch_reference_backend_equals_transformers(arch_dir: Path) -> None:
    prompts, want_tokens, want_logprobs = oracle(arch_dir, "varied")
    tokens, logprobs, _ = generate(arch_dir, prompts, attention_backend="torch")
    check(tokens, logprobs, want_tokens, want_logprobs)


def test_two_ranks_equal_transformers(arch_dir: Path) -> None:
    prompts, want_tokens, want_logprobs = oracle(arch_dir, "varied")
    tokens, logprobs, _ = generate(arch_dir, prompts[:5], tensor_parallel_size=2)
    check(tokens, logprobs, want_tokens[:5], want_logprobs[:5])


def test_windows_and_sharding_read_from_the_config(arch_dir: Path) -> None:
    cfg = load_hf_config(arch_dir)
    info = describe(cfg)
    windows = {
        "gemma2": (21, None, 21),
        "gemma3_text": (19, None, 19),
        "phi3": (27, 27),
        "mixtral": (None, None),
        "qwen3_moe": (None, None, None),
        "mistral": (21, 21),
    }[cfg.model_type]
    assert info.sliding_windows == windows
    if dict(info.divisible).get("experts"):
        assert not info.graph_safe  # routing reads counts on the host
        with pytest.raises(ModelLoadError, match=r"does not divide .*the 4 experts"):
            check_shardable(info.divisible, info.num_kv_heads, 3)


@pytest.mark.parametrize("arch_dir", ["mistral"], indirect=True)
def test_a_model_windowed_in_every_layer_holds_only_its_window(arch_dir: Path) -> None:
    """One request at a time in chunks of 16, blocks of 8, window 21: a request never holds
    more than the blocks its window and one chunk span, where the longest prompt alone would
    take 42 blocks, and the tokens still equal transformers'."""
    prompts, want_tokens, want_logprobs = oracle(arch_dir, "varied")
    held: list[int] = []
    settings = {"max_num_seqs": 1, "max_num_batched_tokens": 16, "block_size": 8}
    with LLM(str(arch_dir), max_model_len=384, num_kv_blocks=48, **settings) as llm:
        kv = llm.engine.kv
        allocate = kv.allocate_slots

        def counted(seq, num_new, computed=None):
            ok = allocate(seq, num_new, computed)
            held.append(sum(1 for b in kv.block_table(seq) if b >= 0))
            return ok

        kv.allocate_slots = counted  # type: ignore[method-assign]
        outputs = llm.generate(prompts, GREEDY)
        assert kv.pool.num_free == kv.pool.num_blocks
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
    ]
    check(tokens, logprobs, want_tokens, want_logprobs)
    assert max(held) <= -(-(21 + 16) // 8) + 1
