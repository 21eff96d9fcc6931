"""Offline throughput: pagedserve's `LLM.generate` against transformers' static-batch `generate`.

Same model, same prompts, same output lengths, greedy, EOS ignored. transformers runs the
requests in static batches of `--batch-size` (each batch runs until its longest request ends:
that is what static batching costs); pagedserve runs them all with `max_num_seqs=--batch-size`
(continuous batching). Output tokens/s counts only the tokens each request asked for.

    python bench/serving/offline_throughput.py [--model DIR] [--num-prompts 16] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass

import torch

from engine import LLM, SamplingParams

SKEWED = [32, 128, 64, 256]  # the static-batching example: repeated over the requests


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = [
        "the",
        "engine",
        "schedules",
        "every",
        "request",
        "at",
        "each",
        "step",
        "while",
        "blocks",
        "of",
        "the",
        "cache",
        "are",
        "shared",
        "between",
        "prompts",
        "that",
        "begin",
        "alike",
        "and",
        "the",
        "sampler",
        "chooses",
        "one",
        "token",
        "per",
        "row",
    ]
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 90)))
        prompts.append(tokenizer(text).input_ids)
    return prompts


def run_ours(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> Result:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(lengths), (produced, sum(lengths))
    return Result("pagedserve", produced, seconds)


def run_transformers(
    model, pad_id: int, prompts: list[list[int]], lengths: list[int], batch_size: int
) -> Result:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], lengths[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(want),
                eos_token_id=None,
                pad_token_id=pad_id,
            )
    return Result("transformers", sum(lengths), time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--equal-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llm = LLM(
        args.model,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(llm.tokenizer, args.num_prompts, args.seed)

    # Warm both up once (first-call kernel selection and allocation are not throughput).
    run_ours(llm, prompts[:2], [4, 4])
    run_transformers(hf, pad_id, prompts[:2], [4, 4], 2)

    scenarios = {
        f"equal ({args.equal_len} each)": [args.equal_len] * args.num_prompts,
        f"skewed ({', '.join(map(str, SKEWED))}, repeated)": [
            SKEWED[i % len(SKEWED)] for i in range(args.num_prompts)
        ],
    }
    print(
        f"# {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()} | torch {torch.__version__} "
        f"| threads {torch.get_num_threads()} | model {llm.engine.model_path.name} | {args.num_prompts} prompts "
        f"of {min(map(len, prompts))}-{max(map(len, prompts))} tokens | batch {args.batch_size}"
    )
    print("| scenario | output tokens | pagedserve tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, lengths in scenarios.items():
        ours = run_ours(llm, prompts, lengths)
        theirs = run_transformers(hf, pad_id, prompts, lengths, args.batch_size)
        print(
            f"| {name} | {ours.tokens} | {ours.tok_s:.1f} | {theirs.tok_s:.1f} | {ours.tok_s / theirs.tok_s:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
