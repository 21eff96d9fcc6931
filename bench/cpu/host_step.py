"""The engine's own host work per decode step, measured on a CPU.

On a GPU a decode step's kernels take ~1 ms for a small model, and everything the engine does on
the host around them (schedule, build the batch, sample, detokenize, make outputs) adds to every
step: on an H100 the Qwen3-0.6B-shaped step was 4.5 ms at batch 1 against a 0.4 ms floor
(bench/RESULTS.md). This runs the engine on a one-layer model of width 32 (its forward costs
next to nothing), so `engine.step()` time is that host work, which a CPU measures as well as a
GPU machine would:

    python bench/cpu/host_step.py [--batches 1 64 256] [--steps 100] [--profile]

Every sequence decodes greedily (EOS ignored) with a 32-token prompt; the timed steps start once
every prompt is in. `--profile` prints the functions taking the most time at the largest batch.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams
from tests.support.models import build_random_model

PROMPT_LEN = 32


def build_tiny_llama(folder: Path) -> Path:
    """A one-layer Llama of width 32 (real tokenizer): its forward is negligible, so a step's
    time is the engine's host work."""
    return build_random_model(
        folder,
        "llama",
        "llama",
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def step_ms(folder: Path, batch: int, steps: int, profile: bool) -> float:
    max_len = PROMPT_LEN + 2 * steps + 16
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        max_model_len=max_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
        num_kv_blocks=batch * -(-max_len // 16) + 16,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 4000 + 10 for j in range(PROMPT_LEN)]
        engine.add_request(prompt, params, prompt_token_ids=prompt)
    for _ in range(3):  # every prompt in, then a decode step or two
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        assert len(engine.step()) == batch
    ms = (time.perf_counter() - start) / steps * 1e3
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(min(steps, 50)):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the forward is negligible; one thread keeps the timing steady
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_llama(Path(tmp))
        for batch in args.batches:
            last = batch == max(args.batches)
            ms = step_ms(folder, batch, args.steps, args.profile and last)
            print(
                f"batch {batch:4d}: {ms:7.2f} ms per step, {ms * 1e3 / batch:6.1f} us per sequence"
            )


if __name__ == "__main__":
    main()
