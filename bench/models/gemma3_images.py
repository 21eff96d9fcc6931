"""What Gemma 3's both-ways image attention costs on the CPU: the time to prefill prompts with
one image each (and sample one token), with the image rows recomputed both ways (what
transformers computes) against the causal attention alone (what a model without that rule
would compute), side by side on one engine, the rounds alternating which goes first.

    python bench/models/gemma3_images.py [--requests 4] [--rounds 3] [--layers 6]

The model is a random-weight Gemma 3 of real shapes where it matters here: 256 soft tokens
per image (a 224 px SigLIP tower in 14 px patches, 4 layers of width 384), a text model of
Gemma 3 1B's width (1152, 4 heads of 256 over one KV head, MLP 6912) with `--layers` layers,
five sliding (window 512) to each global one. Every request has its own image, so nothing is
found in the prefix or encoder caches.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams
from engine.models import gemma3_vl
from tests.support.gemma3_models import build_gemma3
from tests.support.vision_models import sample_image

PROMPT = "<start_of_turn>user\ndescribe<start_of_image> in one line<end_of_turn>\n"


def build(folder: Path, layers: int) -> Path:
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return build_gemma3(
        folder,
        image_px=224,
        tokens_per_image=256,
        vision={
            "hidden_size": 384,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 6,
            "patch_size": 14,
        },
        text={
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "layer_types": kinds,
        },
    )


def prefill_seconds(llm: LLM, requests: int, first_seed: int) -> float:
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": [sample_image(first_seed + i)]}}
        for i in range(requests)
    ]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    both_ways = gemma3_vl.ImagesBothWays
    times: dict[str, list[float]] = {"both_ways": [], "causal_only": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp), args.layers)
        with LLM(str(folder), dtype="float32", max_model_len=1024) as llm:
            prefill_seconds(llm, 1, 10_000)  # warm-up
            seed = 0
            for round_ in range(args.rounds):
                order = ["both_ways", "causal_only"]
                for mode in order if round_ % 2 == 0 else order[::-1]:
                    gemma3_vl.ImagesBothWays = (  # type: ignore[misc]
                        both_ways if mode == "both_ways" else (lambda backend, spans: backend)
                    )
                    times[mode].append(prefill_seconds(llm, args.requests, seed))
                    seed += args.requests
            gemma3_vl.ImagesBothWays = both_ways  # type: ignore[misc]
    median = {mode: statistics.median(t) for mode, t in times.items()}
    # The fastest round of each: the least disturbed by other work on a shared machine.
    fastest = {mode: min(t) for mode, t in times.items()}
    print(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads",
                "requests": args.requests,
                "text_layers": args.layers,
                "seconds": times,
                "median_seconds": median,
                "fastest_seconds": fastest,
                "both_ways_over_causal_median": round(
                    median["both_ways"] / median["causal_only"], 3
                ),
                "both_ways_over_causal_fastest": round(
                    fastest["both_ways"] / fastest["causal_only"], 3
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
