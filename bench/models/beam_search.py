"""Beam search k=4 against the same prompt as 4 independent greedy requests, side by side in
one process: wall time, tokens/s (k sequences x output tokens, the work both do) and the KV
blocks held at the peak. The beams share the prompt's blocks by forking; the independent
requests share them only through the prefix cache, so both settings of it are run.

    PYTHONPATH=. python bench/models/beam_search.py [MODEL_DIR] [--input-len 512] [--output-len 64]
        [--width 4] [--dtype auto] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine import LLM, SamplingParams
from engine.beam_search import BeamSearchParams
from engine.llm_engine import LLMEngine


def run(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> dict[str, float]:
    """Queue every request at once, step to the end; time and the peak of blocks in use."""
    pool = engine.kv.pool
    start, cpu_start = time.perf_counter(), time.process_time()
    for p in params:
        engine.add_request(prompt, p)
    peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, pool.num_blocks - pool.num_free)
    seconds = time.perf_counter() - start
    # CPU time of this process (all its threads): less moved than wall time by other load.
    cpu_seconds = time.process_time() - cpu_start
    assert pool.num_free == pool.num_blocks  # every block back
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "steps": steps, "peak_blocks": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    k, out_len = args.width, args.output_len
    longest = args.input_len + out_len + 16
    beam = BeamSearchParams(k, out_len, ignore_eos=True).to_sampling_params()
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    rows = []
    for caching in (False, True):
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=longest,
            max_num_seqs=max(8, k),
            num_kv_blocks=k * -(-longest // 16) + 16,
            block_size=16,
            enable_prefix_caching=caching,
        )
        run(llm.engine, [1, 2, 3], [greedy])  # warm-up: the first steps are the slower
        for r in range(args.runs):  # alternated, so that drift hits both alike
            # Fresh prompts per run: no run finds an earlier one's blocks in the prefix cache.
            prompt = torch.randint(
                100, 20000, (args.input_len,), generator=torch.Generator().manual_seed(r)
            ).tolist()
            for name, params in (
                (f"beam search k={k}", [beam]),
                (f"{k} independent", [greedy] * k),
            ):
                result = run(llm.engine, prompt, params)
                result["tok_per_s"] = k * out_len / result["seconds"]
                rows.append({"prefix_caching": caching, "run": r, "mode": name, **result})
                print(json.dumps(rows[-1]))
        llm.close()
    print(
        f"\n| mode | prefix cache | run | seconds | CPU seconds | steps "
        f"| tok/s ({k} x {out_len}) | peak KV blocks |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {'on' if row['prefix_caching'] else 'off'} | {row['run']} "
            f"| {row['seconds']:.2f} | {row['cpu_seconds']:.2f} | {row['steps']} "
            f"| {row['tok_per_s']:.1f} "
            f"| {row['peak_blocks']} |"
        )


if __name__ == "__main__":
    main()
