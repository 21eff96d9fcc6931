"""Image input on the CPU: images/s and TTFT of a LLaVA-shaped model, offline, with repeated
images (the encoder cache serves all but the first) against distinct ones (every image
encoded), side by side in one run.

    python bench/models/multimodal.py [--requests 16] [--rounds 2] [--output-len 16]

No vision-language checkpoint can be had offline, so the model is a random-weight LLaVA of
real shapes: a CLIP ViT-B/16 tower at 224 px (196 image tokens, 12 layers, width 768), the
two-layer projector, and a Llama text model of SmolLM2-135M's shape (30 layers, width 576)
with the Llama-3.2 tokenizer. Each request is one chat turn with one image and asks for
`--output-len` tokens (greedy, ignoring EOS); all requests are submitted at once, each with
words of its own before its image (the prefix cache finds no image of another request). TTFT is the
engine's own, per request, as the metrics record it. Both workloads run on one engine, the
rounds alternating which goes first.
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
from tests.support.vision_models import build_llava, sample_image

# Each request's own words come before its image, so that no prompt finds another's image in
# the prefix cache: what a repeated image saves here is its encoding alone.
PROMPT = "<|user|>\nrequest {}: describe <image> in one line\n<|assistant|>\n"


def build(folder: Path) -> Path:
    return build_llava(
        folder,
        vision={
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 224,
            "patch_size": 16,
        },
        text={
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        },
        image_px=224,
    )


def run(llm: LLM, images: list, output_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [
        {"prompt": PROMPT.format(i), "multi_modal_data": {"image": [image]}}
        for i, image in enumerate(images)
    ]
    started = time.perf_counter()
    llm.generate(prompts, params)  # type: ignore[arg-type]
    wall = time.perf_counter() - started
    stats = llm.last_run_stats
    return {
        "images_per_s": len(images) / wall,
        "mean_ttft_s": statistics.mean(stats.time_to_first_token),
        "images_encoded": stats.mm_images_encoded,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp))
        llm = LLM(str(folder), max_model_len=512, max_num_seqs=args.requests)
        workloads = {
            "repeated": [sample_image(0, (320, 240))] * args.requests,
            "distinct": [sample_image(i, (320, 240)) for i in range(args.requests)],
        }
        run(llm, workloads["distinct"][:2], 2)  # warm-up: first-call costs out of the numbers
        results: dict[str, list[dict[str, float]]] = {name: [] for name in workloads}
        for round_ in range(args.rounds):
            order = list(workloads) if round_ % 2 == 0 else list(reversed(workloads))
            for name in order:
                # Distinct images each round: the cache must not carry one round into the next.
                images = workloads[name]
                if name == "distinct":
                    images = [
                        sample_image(1000 * (round_ + 1) + i, (320, 240))
                        for i in range(len(images))
                    ]
                else:
                    images = [sample_image(5000 + round_, (320, 240))] * len(images)
                results[name].append(run(llm, images, args.output_len))
        llm.close()
    summary = {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "requests": args.requests,
        "output_len": args.output_len,
        "results": results,
    }
    print(json.dumps(summary, indent=2))
    for name, runs in results.items():
        rate = statistics.mean(r["images_per_s"] for r in runs)
        ttft = statistics.mean(r["mean_ttft_s"] for r in runs)
        print(f"{name:9s} {rate:6.2f} images/s  mean TTFT {ttft:6.2f} s")


if __name__ == "__main__":
    main()
