"""Quantized checkpoints of the default model (compressed-tensors W4A16, W8A16, FP8, and W4A8 and
W8A8 with their dynamic int8 activations) against its bf16 model: greedy agreement and logprob
error, then decode step time side by side.

    python bench/models/quantized_checkpoints.py [--batches 1,16] [--steps 24] [--rounds 5] [--no-timing]

The checkpoints are written once into ~/.cache/pagedserve/ by compressed-tensors' own
compressors (round-to-nearest min-max scales in bf16, int weights in groups of 64 or per row;
the head and embedding stay dense), as llm-compressor would save them without calibration.
Accuracy: four fixed prompts, 16 greedy tokens each, in bfloat16; for each prompt the tokens
agreed before the first difference from the bf16 model, and the largest logprob difference over
them. Timing: bench/models/quantized.py's decode step (best and median round, rounds rotated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantized import decode_step_s, weight_mib

from config.engine_config import default_cache_dir
from engine import LLM, SamplingParams
from engine.loading.default_model import default_model_dir
from tests.support.quantized_checkpoints import compress

CACHE = Path.home() / ".cache" / "pagedserve"
# name -> compressed-tensors preset, format, group size (None: one scale per output row)
SCHEMES = {
    "W4A16 g64": ("W4A16", "pack-quantized", 64),
    "W4A16 asym g64": ("W4A16_ASYM", "pack-quantized", 64),
    "W8A16 per row": ("W8A16", "pack-quantized", None),
    "FP8 dynamic": ("FP8_DYNAMIC", "float-quantized", None),
    # Dynamic int8 activations declared: served with the integer products where they run.
    "W4A8 g64": ("W4A8", "pack-quantized", 64),
    "W8A8 per row": ("W8A8", "int-quantized", None),
}
# The default tokenizer's ids of "The capital of France is", "def fibonacci(n):", "Water boils
# at a temperature of", "Once upon a time, there was a" (as tests/engine/loading/test_gguf.py).
PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1604, 3987, 46477, 24, 94, 727],
    [12615, 36411, 418, 253, 2779, 282],
    [6403, 1980, 253, 655, 28, 665, 436, 253],
]


def checkpoint(name: str, src: Path) -> Path:
    preset, fmt, group = SCHEMES[name]
    folder = CACHE / f"smollm2-135m-{name.lower().replace(' ', '-')}"
    if not (folder / "config.json").is_file():
        compress(src, folder, preset, fmt, group)
    return folder


def engine(model: Path, batch: int = 4, max_len: int = 128) -> LLM:
    return LLM(
        str(model),
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        num_kv_blocks=batch * -(-max_len // 16) + 8,
    )


def traces(llm: LLM) -> list[list[tuple[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    return [
        [(t, float(next(iter(lp.values())))) for t, lp in zip(s.token_ids, s.logprobs or [])]
        for s in (o.outputs[0] for o in llm.generate(PROMPTS, params))
    ]


def agreement(base: list[tuple[int, float]], other: list[tuple[int, float]]) -> tuple[int, float]:
    agreed = 0
    while agreed < len(base) and base[agreed][0] == other[agreed][0]:
        agreed += 1
    worst = max((abs(a[1] - b[1]) for a, b in zip(base[:agreed], other[:agreed])), default=0.0)
    return agreed, worst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    src = default_model_dir(default_cache_dir())
    folders = {"bf16": src, **{name: checkpoint(name, src) for name in SCHEMES}}
    with engine(src) as llm:
        base = traces(llm)
    print("| checkpoint | tokens agreed (of 16) per prompt | largest logprob difference |")
    print("|---|---|---:|")
    for name in SCHEMES:
        with engine(folders[name]) as llm:
            rows = [agreement(b, o) for b, o in zip(base, traces(llm))]
        agreed = ", ".join(str(a) for a, _ in rows)
        print(f"| {name} | {agreed} | {max(w for _, w in rows):.3f} |", flush=True)
    if args.no_timing:
        return
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.context + args.steps + 8
    llms = {name: engine(folder, max(batches), max_len) for name, folder in folders.items()}
    for llm in llms.values():  # warm-up: first calls pay one-off costs
        decode_step_s(llm, max(batches), args.context, 4, seed=0)
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(llms)[r % len(llms) :] + list(llms)[: r % len(llms)]
        for batch in batches:
            for name in order:
                step = decode_step_s(llms[name], batch, args.context, args.steps, seed=r)
                times.setdefault((name, batch), []).append(step)
    print("| weights | requests | decode step ms, best | median | vs bf16 | weights MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in batches:
        best_bf16 = min(times[("bf16", batch)])
        for name, llm in llms.items():
            best = min(times[(name, batch)])
            median = statistics.median(times[(name, batch)])
            print(
                f"| {name} | {batch} | {best * 1e3:.2f} | {median * 1e3:.2f} | "
                f"{best_bf16 / best:.2f} | {weight_mib(llm):.0f} |"
            )


if __name__ == "__main__":
    main()
