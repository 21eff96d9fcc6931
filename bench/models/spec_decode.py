"""Speculative decoding against none, side by side, offline, on a copy-heavy workload: output
tokens/s of `LLM.generate` at each concurrency.

    python bench/models/spec_decode.py [--model DIR] [--method ngram|draft_model] [--draft-layers 6]
        [--concurrency 1 4 16] [--rounds 2] [--k 4] [--always] [--batch-invariant]

`--method draft_model` drafts with the model's own first `--draft-layers` layers (then its final
norm and LM head): no smaller model of the default model's tokenizer can be had offline, and a
truncated copy is a real draft that agrees with its target often, at a fraction of its cost.

The workload is chat requests to the default model (SmolLM2-135M-Instruct) whose answers copy
their input: repeat a passage, return a code snippet with one change, quote a paragraph's
sentences in order. Greedy, 128 tokens out at most, `max_num_seqs` = the concurrency, that many
requests at once, each request rendered with the model's chat template. Both engines are built
once and the rounds alternate which runs first, so that drift on a shared machine falls on both.
Greedy tokens are the same with and without speculation when each row is computed the same
whatever the batch around it: `--batch-invariant` checks that every request's tokens are equal.
Without it (the default engine, bfloat16) a row's rounding depends on its batch, with or without
drafts, so the table counts the requests whose tokens came out the same.
`--always` speculates at every batch size (`disable_by_batch_size` past the largest), which is
how the default threshold was measured; without it the config's default applies.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams

OUTPUT_LEN = 128

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers moved their animals to the hill behind the church, where the ground "
    "stayed dry, and the children carried sandbags to the doors of the old mill.",
    "A lighthouse keeper writes the weather in a log every four hours: the wind, the sea, "
    "the clouds and the ships that pass. The log is the only company he has in winter, and "
    "he reads the old pages when the storms keep him awake.",
    "Bread needs flour, water, salt and time. Mix them, let the dough rest for an hour, fold "
    "it, rest it again, shape it, and bake it in a hot oven until the crust sounds hollow "
    "when you knock on it.",
    "The library opens at nine and closes at six. Members may borrow five books for three "
    "weeks, and renew them twice online. Late returns cost ten cents a day, and lost books "
    "must be replaced or paid for.",
]
CODE = [
    "def total(prices):\n    result = 0\n    for price in prices:\n        result += price\n"
    "    return result\n\n\ndef average(prices):\n    return total(prices) / len(prices)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n\n    def reset(self):\n        self.count = 0\n",
]


OPEN_ENDED = [
    "Write a short story about a fox who learns to swim.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a birthday party in winter.",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the pros and cons of working from home?",
    "Invent a new board game and explain its rules.",
]


def conversations(count: int, workload: str = "copy") -> list[list[dict[str, str]]]:
    if workload == "open":
        return [
            [{"role": "user", "content": OPEN_ENDED[i % len(OPEN_ENDED)]}] for i in range(count)
        ]
    asks = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
    asks += [
        f"Rename the variable 'result' to 'sum' in this code and show all of it:\n\n{c}"
        for c in CODE
    ]
    asks += [f"Quote each sentence of this paragraph on its own line:\n\n{p}" for p in PASSAGES[:2]]
    return [[{"role": "user", "content": asks[i % len(asks)]}] for i in range(count)]


def truncated_copy(model_dir: Path, layers: int, out: Path) -> Path:
    """A copy of a Llama-family folder keeping only its first `layers` decoder layers."""
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for extra in model_dir.iterdir():
        if extra.name.startswith("tokenizer") or extra.name == "chat_template.jinja":
            (out / extra.name).write_bytes(extra.read_bytes())
    kept = {}
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        parts = name.split(".")
        if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
            continue
        kept[name] = tensor
    save_file(kept, out / "model.safetensors")
    return out


def run(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]], float]:
    """Output tok/s, every request's tokens, and the acceptance rate of its drafts."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [o.outputs[0].token_ids for o in outputs]
    stats = llm.last_run_stats.spec_decode
    rate = stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
    return sum(len(t) for t in tokens) / elapsed, tokens, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder, or the default")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument(
        "--workload",
        choices=["copy", "open"],
        default="copy",
        help="copy: answers that copy the prompt; open: open-ended answers (few drafts fit)",
    )
    parser.add_argument("--always", action="store_true", help="speculate at every batch size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-invariant", action="store_true")
    args = parser.parse_args()
    spec: dict[str, object] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        from config.engine_config import default_cache_dir
        from engine.loading.default_model import default_model_dir

        target = Path(args.model) if args.model else default_model_dir(default_cache_dir())
        draft = Path(tempfile.mkdtemp()) / f"first-{args.draft_layers}-layers"
        spec["model"] = str(truncated_copy(target, args.draft_layers, draft))
    if args.always:
        spec["disable_by_batch_size"] = max(args.concurrency) + 1
    settings = {
        "dtype": args.dtype,
        "max_model_len": 1024,
        "max_num_seqs": max(args.concurrency),
        "max_num_batched_tokens": 4096,
        "batch_invariant": args.batch_invariant,
        "enable_prefix_caching": False,  # every run prefills its prompts, as new requests do
    }
    model = args.model
    engines = {
        name: LLM(model, speculative_config=cfg, **settings)
        for name, cfg in (("none", None), ("spec", spec))
    }
    warm = engines["none"]
    work = [warm.render_chat(c) for c in conversations(max(args.concurrency), args.workload)]
    for llm in engines.values():  # warm-up: each batch shape's first-call kernel costs
        for c in args.concurrency:
            run(llm, work[:c])
    print(
        f"{platform.processor() or platform.machine()}, model {model or 'default'}, "
        f"workload {args.workload}, {json.dumps(spec)}"
    )
    print(f"| concurrency | round | none tok/s | {args.method} tok/s | ratio | accepted | same |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        for r in range(args.rounds):
            order = ("none", "spec") if r % 2 == 0 else ("spec", "none")
            got = {name: run(engines[name], work[:c]) for name in order}
            same = sum(a == b for a, b in zip(got["spec"][1], got["none"][1]))
            if args.batch_invariant:
                assert same == c, "greedy tokens differ with speculation"
            ratio = got["spec"][0] / got["none"][0]
            print(
                f"| {c} | {r} | {got['none'][0]:.1f} | {got['spec'][0]:.1f} | {ratio:.3f} | "
                f"{got['spec'][2]:.2f} | {same}/{c} |",
                flush=True,
            )
    for llm in engines.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
