"""The cost of --batch-invariant: the default engine and a batch-invariant one on the same model
in one process, the same workloads alternated round by round, best round of each.

Two workloads: serving-shaped (N requests, IN prompt tokens, OUT output tokens, greedy, EOS
ignored: output tok/s) and prefill alone (P prompts of L tokens, one output token: prompt tok/s),
where the flag costs most (every prompt row attends through the decode path).

    python bench/quality/batch_invariant.py [--model DIR] [--requests 32] [--input-len 128]
        [--output-len 64] [--prefill-prompts 8] [--prefill-len 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import LLM, SamplingParams


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Fresh random token ids per round, so that no round hits an earlier one's prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def _timed(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    engines = {
        mode: LLM(args.model, dtype="bfloat16", batch_invariant=mode == "invariant")
        for mode in ("default", "invariant")
    }
    vocab = len(engines["default"].tokenizer)
    best: dict[str, dict[str, float]] = {m: {"output": 0.0, "prefill": 0.0} for m in engines}
    for llm in engines.values():  # warm-up: first-call allocations are not throughput
        _timed(llm, _prompts(vocab, 4, 64, seed=-1), 4)
    for r in range(args.rounds):
        for mode, llm in engines.items():
            serving = _prompts(vocab, args.requests, args.input_len, seed=2 * r)
            seconds = _timed(llm, serving, args.output_len)
            best[mode]["output"] = max(
                best[mode]["output"], args.requests * args.output_len / seconds
            )
            prefill = _prompts(vocab, args.prefill_prompts, args.prefill_len, seed=2 * r + 1)
            seconds = _timed(llm, prefill, 1)
            best[mode]["prefill"] = max(
                best[mode]["prefill"], args.prefill_prompts * args.prefill_len / seconds
            )
    report = {
        "settings": vars(args),
        "output_tok_s": {m: round(b["output"], 1) for m, b in best.items()},
        "prefill_tok_s": {m: round(b["prefill"], 1) for m, b in best.items()},
        "invariant_over_default": {
            kind: round(best["invariant"][kind] / best["default"][kind], 3)
            for kind in ("output", "prefill")
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
