"""The cost of LoRA adapters: decode throughput of one batch of 16 requests with 0, 1, 4 and 8
distinct adapters among them, against the base model served without --enable-lora, on the same
model in one process, alternated round by round, best round of each.

The adapters are PEFT adapters made here on the model's own architecture (rank --rank, every
projection targeted, random A and B). "0 adapters" runs the LoRA engine with every row on the
base model: what turning LoRA on costs by itself (on the CPU, the Python layers instead of the
C++ layer loop). Each run: 16 requests of --input-len random prompt tokens and --output-len
output tokens, greedy, EOS ignored; output tok/s over the whole call (decode-dominated).

    python bench/models/lora.py [--model DIR] [--rank 16] [--input-len 32] [--output-len 64]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, LoRARequest, SamplingParams

BATCH = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model_dir(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    from config.engine_config import default_cache_dir
    from engine.loading.default_model import default_model_dir

    return default_model_dir(default_cache_dir())


def _make_adapters(model_dir: Path, folder: Path, count: int, rank: int) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    requests = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        model.save_pretrained(folder / f"adapter{i}")
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(folder / f"adapter{i}")))
    return requests


def _prompts(vocab: int, length: int, seed: int) -> list[list[int]]:
    """Fresh random token ids per run, so that no run hits an earlier one's prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(BATCH)]


def _timed(
    llm: LLM, prompts: list[list[int]], output_len: int, loras: list[LoRARequest | None]
) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=loras if any(loras) else None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model_dir = _model_dir(args.model)
    with tempfile.TemporaryDirectory() as folder:
        adapters = _make_adapters(model_dir, Path(folder), 8, args.rank)
        base = LLM(str(model_dir), dtype="bfloat16")
        lora = LLM(
            str(model_dir),
            dtype="bfloat16",
            enable_lora=True,
            max_loras=8,
            max_lora_rank=args.rank,
        )
        vocab = len(base.tokenizer)
        cases: dict[str, tuple[LLM, list[LoRARequest | None]]] = {"base": (base, [None] * BATCH)}
        for distinct in (0, 1, 4, 8):
            rows = [adapters[i % distinct] if distinct else None for i in range(BATCH)]
            cases[f"lora, {distinct} adapters"] = (lora, rows)
        for llm, rows in cases.values():  # warm-up: first-call allocations, adapters into slots
            _timed(llm, _prompts(vocab, 8, seed=-1), 4, rows)
        best = dict.fromkeys(cases, 0.0)
        for r in range(args.rounds):
            for i, (name, (llm, rows)) in enumerate(cases.items()):
                prompts = _prompts(vocab, args.input_len, seed=r * len(cases) + i)
                seconds = _timed(llm, prompts, args.output_len, rows)
                best[name] = max(best[name], BATCH * args.output_len / seconds)
    report = {
        "settings": {**vars(args), "model": str(model_dir), "batch": BATCH},
        "output_tok_s": {name: round(value, 1) for name, value in best.items()},
        "over_base": {name: round(value / best["base"], 3) for name, value in best.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
