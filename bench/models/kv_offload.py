"""The KV offload tiers on the CPU, side by side in one run: time to first token when a
conversation comes back to a long document the pool has evicted, with no tier, the host tier and
the disk tier (read after a restart), and the write-through's cost when nothing is revisited.

    python bench/models/kv_offload.py [--model DIR] [--docs 4] [--doc-len 1024] [--turns 3] [--rounds 2]

Workload: `--docs` conversations, each over a document of `--doc-len` random tokens; a turn sends
the document and every question so far (`--question-len` tokens each), as a chat client re-sends
its history. Turns go round the conversations (turn 1 of each, then turn 2 of each, ...), one
request at a time, greedy, `max_tokens` 1: the wall time of each request is its time to first
token. The pool holds about 1.5 documents (`--pool-docs`), so every revisit finds its document
evicted from the pool, and only a tier can give it back.

- none: prefix caching in the pool alone;
- host: `--kv-offloading-size` large enough for every document;
- disk: turn 1 on an engine with a disk tier (`--kv-offloading-disk-dir`, a temporary folder), then
  a new engine on the same folder with no host tier (a restart), which runs the later turns.

TTFT is the mean over the revisits (turns 2 and later); the hit rate is the tier's tokens found
over the tokens asked. Then the write-through's cost: output tok/s and the process's CPU seconds
for `--overhead-requests` requests of distinct random prompts (128 in, 64 out, all at once) with
no tier, the host tier, the disk tier and both, each arm in a process of its own, the order
turning every round. On a shared machine CPU seconds vary less than tok/s.
"""

from __future__ import annotations

import argparse
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams

BLOCK = 16
FIRST = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class Visits:
    """What one arm measured over the revisits."""

    ttft_s: list[float] = field(default_factory=list)
    queries: int = 0
    hits: int = 0

    def add(self, llm: LLM, prompt: list[int]) -> None:
        start = time.perf_counter()
        llm.generate([prompt], FIRST)
        self.ttft_s.append(time.perf_counter() - start)
        stats = llm.last_run_stats
        self.queries += stats.external_prefix_cache_queries
        self.hits += stats.external_prefix_cache_hits


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: the document, then the questions so far."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    turns = []
    for _ in range(args.docs):
        prompt = tokens(args.doc_len)
        history = []
        for _ in range(args.turns):
            prompt = prompt + tokens(args.question_len)
            history.append(prompt)
        turns.append(history)
    return turns


def engine(args: argparse.Namespace, **tiers: object) -> LLM:
    pool_blocks = int(args.pool_docs * (args.doc_len + args.turns * args.question_len) / BLOCK)
    return LLM(
        args.model,
        dtype=args.dtype,
        block_size=BLOCK,
        num_kv_blocks=pool_blocks,
        max_model_len=args.doc_len + args.turns * args.question_len + 16,
        max_num_batched_tokens=2048,
        **tiers,
    )


def revisits(args: argparse.Namespace, work: list[list[list[int]]], arm: str, dirs: Path) -> Visits:
    """The later turns' TTFT on one arm (the first turns run unmeasured: they fill the tiers)."""
    doc_bytes_gib = 4 * args.docs * (args.doc_len + args.turns * args.question_len) / 2**20 / 1024
    visits = Visits()
    if arm == "disk":
        folder = dirs / f"disk-{time.monotonic_ns()}"
        disk = {"kv_offloading_disk_dir": str(folder), "kv_offloading_disk_size": 8.0}
        first = engine(args, **disk)
        for conv in work:
            first.generate([conv[0]], FIRST)
        first.close()
        del first
        llm = engine(args, **disk)  # the restart: only what the disk kept
    else:
        tiers = {"kv_offloading_size": max(1.0, doc_bytes_gib)} if arm == "host" else {}
        llm = engine(args, **tiers)
        for conv in work:
            llm.generate([conv[0]], FIRST)
    for turn in range(1, args.turns):
        for conv in work:
            visits.add(llm, conv[turn])
    llm.close()
    return visits


OVERHEAD_ARMS = ("none", "host", "disk", "both")


def overhead_arm(args: argparse.Namespace, arm: str, dirs: Path, seed: int) -> tuple[float, float]:
    """Output tok/s and the process's CPU seconds (every thread, the disk writer's too) of one
    arm on prompts that share nothing, on an engine of its own; the disk writes are waited for."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    settings = {"dtype": args.dtype, "max_model_len": 256, "max_num_seqs": args.overhead_requests}
    host = {"kv_offloading_size": 1.0}
    disk = {
        "kv_offloading_disk_dir": str(dirs / f"overhead-{seed}"),
        "kv_offloading_disk_size": 4.0,
    }
    tiers = {"none": {}, "host": host, "disk": disk, "both": {**host, **disk}}[arm]
    llm = LLM(args.model, **settings, **tiers)
    vocab = llm.tokenizer.vocab_size
    llm.generate([[100 + i for i in range(32)]], params)  # first-call costs
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(args.overhead_requests)
    ]
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if llm.engine.offload is not None:
        llm.engine.offload.flush()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    llm.close()
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, cpu


def write_through_cost(
    args: argparse.Namespace, dirs: Path
) -> list[dict[str, tuple[float, float]]]:
    """Per round, each arm's (tok/s, CPU s). Each arm runs in a process of its own, the order
    turning every round: two engines built one after the other in one process ran at different
    speeds whichever arm came second (0.83x and 1.27x), which swamped a cost of a few percent."""
    rounds = []
    for r in range(args.rounds):
        got = {}
        shift = r % len(OVERHEAD_ARMS)
        for arm in OVERHEAD_ARMS[shift:] + OVERHEAD_ARMS[:shift]:
            cmd = [sys.executable, __file__, "--overhead-arm", arm, "--seed", str(args.seed + r)]
            cmd += ["--dtype", args.dtype, "--overhead-requests", str(args.overhead_requests)]
            cmd += ["--scratch", str(dirs)] + (["--model", args.model] if args.model else [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rate, cpu = done.stdout.strip().splitlines()[-1].split()
            got[arm] = (float(rate), float(cpu))
        rounds.append(got)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder, or the default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--pool-docs", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--overhead-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--overhead-only", action="store_true", help="only the write-through cost")
    parser.add_argument("--overhead-arm", choices=OVERHEAD_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead_arm:  # one arm of the write-through cost, in a process of its own
        print(*overhead_arm(args, args.overhead_arm, args.scratch, args.seed))
        return
    dirs = Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
    try:
        probe = LLM(args.model, dtype=args.dtype, num_kv_blocks=64, max_model_len=256)
        vocab = probe.tokenizer.vocab_size
        probe.close()
        del probe
        work = conversations(args, vocab)
        print(
            f"{platform.processor() or platform.machine()}, model {args.model or 'default'}, "
            f"{args.dtype}: {args.docs} conversations of {args.turns} turns over "
            f"{args.doc_len}-token documents, pool of {args.pool_docs} documents"
        )
        if not args.overhead_only:
            arms = ("none", "host", "disk")
            results: dict[str, list[Visits]] = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else tuple(reversed(arms)):
                    results[arm].append(revisits(args, work, arm, dirs))
            print("| arm | round | revisit TTFT mean ms | p50 ms | tier hit rate | vs none |")
            print("|---|---:|---:|---:|---:|---:|")
            for r in range(args.rounds):
                base = statistics.mean(results["none"][r].ttft_s)
                for arm in arms:
                    v = results[arm][r]
                    mean = statistics.mean(v.ttft_s)
                    rate = f"{v.hits / v.queries:.2f}" if v.queries else "-"
                    print(
                        f"| {arm} | {r + 1} | {mean * 1e3:.0f} | "
                        f"{statistics.median(v.ttft_s) * 1e3:.0f} | {rate} | {mean / base:.2f}x |"
                    )
        if not args.skip_overhead:
            rounds = write_through_cost(args, dirs)
            print("\n| round | " + " | ".join(f"{a} tok/s, CPU s" for a in OVERHEAD_ARMS) + " |")
            print("|---:|" + "---:|" * len(OVERHEAD_ARMS))
            for r, got in enumerate(rounds, 1):
                cells = [f"{got[a][0]:.0f}, {got[a][1]:.2f}" for a in OVERHEAD_ARMS]
                print(f"| {r} | " + " | ".join(cells) + " |")
            for arm in OVERHEAD_ARMS[1:]:
                rate = statistics.median(got[arm][0] / got["none"][0] for got in rounds)
                cpu = statistics.median(got[arm][1] / got["none"][1] for got in rounds)
                print(f"{arm}: median tok/s {rate:.3f}x, CPU seconds {cpu:.3f}x of none")
    finally:
        shutil.rmtree(dirs, ignore_errors=True)


if __name__ == "__main__":
    main()
