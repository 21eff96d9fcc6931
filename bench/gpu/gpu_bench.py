"""GPU throughput: pagedserve's `LLM.generate` against transformers, and the decode step against
the memory-bandwidth floor, on random-weight models shaped like Qwen3-0.6B and Llama-3.2-1B.

    python bench/gpu/gpu_bench.py --out bench/out/gpu_bench.json       # on a CUDA machine
    python bench/gpu/gpu_bench.py --tiny --out /tmp/tiny.json           # the same code paths on a CPU, in seconds

Workload: --num-requests requests whose prompt and output lengths are each uniform in
[--min-len, --max-len] (seeded); prompts are random token ids (no special tokens); greedy, EOS
ignored, so every request produces exactly its output length. Output tok/s counts only the tokens
each request asked for. Every system runs in a process of its own (bench/gpu/gpu_bench_worker.py).

- pagedserve: all requests in one `LLM.generate` (continuous batching, prefix caching off),
  after a short warm-up.
- transformers `generate`: static batches (left-padded, in workload order, each batch running
  until its longest request ends), on the first --hf-requests requests (default: one batch of the
  model's batch size); the lengths are drawn independently, so that is a random subset.
- transformers `generate_batch` (continuous batching), on the same subset: it takes one
  max_new_tokens for all, so each request runs to the subset's longest output.
- decode step (Qwen3 shape): mean `engine.step()` time with B sequences all decoding at a context
  of ~--decode-context tokens, against floor = (weight bytes + KV bytes read) / copy bandwidth.

Writes --out (JSON, everything) and the same path with .md (the results section, also printed).
Exits 1 if a pagedserve or transformers-generate measurement failed (generate_batch may fail).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(
    0, str(REPO)
)  # run as a script: `bench.*` and `tests.support.models` come from this checkout

from bench.gpu.gpu_bench_models import SPECS  # noqa: E402

Record = dict[str, object]
RESERVE_S = (
    20  # of a --time-limit-s, kept for each stage still to come, so that none starts with nothing
)


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    tiny: bool
    num_requests: int
    min_len: int
    max_len: int
    models: list[str]
    seed: int
    hf_requests: int | None
    decode_batches: list[int]
    decode_context: int
    decode_steps: int
    copy_bytes: int
    engine_args: Record
    out: Path
    time_limit_s: float | None
    transformers: bool


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a CPU smoke run: 2-layer models, 8 requests of 4-16 tokens, float32",
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda; cpu with --tiny)"
    )
    parser.add_argument(
        "--num-requests", type=int, default=None, help="default 256 (8 with --tiny)"
    )
    parser.add_argument(
        "--min-len", type=int, default=None, help="shortest prompt and output (default 100; 4)"
    )
    parser.add_argument(
        "--max-len", type=int, default=None, help="longest prompt and output (default 1024; 16)"
    )
    parser.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_bench.json")
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="requests timed on transformers (default: one static batch of the model's size; all with --tiny)",
    )
    parser.add_argument(
        "--decode-batches", default=None, help="comma-separated batch sizes (default 1,32,128; 1,4)"
    )
    parser.add_argument(
        "--decode-context", type=int, default=None, help="default 512 (16 with --tiny)"
    )
    parser.add_argument(
        "--decode-steps", type=int, default=None, help="timed steps per batch size (default 32; 4)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="passed to the engine when given (default: the engine's own)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="passed to the engine: no CUDA graphs"
    )
    parser.add_argument(
        "--attention-backend", default=None, help="passed to the engine when given (default: auto)"
    )
    parser.add_argument(
        "--skip-transformers",
        action="store_true",
        help="time pagedserve alone (e.g. a second backend or --enforce-eager on the same run)",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="stop starting stages past this many seconds; a stage cut short is reported",
    )
    args = parser.parse_args(argv)
    tiny = args.tiny

    def pick(value, full, small):
        return value if value is not None else (small if tiny else full)

    device = pick(args.device, "cuda", "cpu")
    max_len = pick(args.max_len, 1024, 16)
    engine_args: Record = {
        "device": device,
        "dtype": "float32" if device == "cpu" else "bfloat16",
        "enable_prefix_caching": False,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    }
    if tiny:  # the CPU default pool (1 GiB) takes longer to allocate than the tiny run takes
        engine_args["num_kv_blocks"] = 256
    # Set only when asked: an engine without these settings still runs the benchmark.
    if args.gpu_memory_utilization is not None:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        engine_args["enforce_eager"] = True
    if args.attention_backend is not None:
        engine_args["attention_backend"] = args.attention_backend
    settings = Settings(
        device=device,
        dtype=engine_args["dtype"],
        tiny=tiny,
        num_requests=pick(args.num_requests, 256, 8),
        min_len=pick(args.min_len, 100, 4),
        max_len=max_len,
        models=args.models,
        seed=args.seed,
        hf_requests=args.hf_requests,
        decode_batches=[int(b) for b in pick(args.decode_batches, "1,32,128", "1,4").split(",")],
        decode_context=pick(args.decode_context, 512, 16),
        decode_steps=pick(args.decode_steps, 32, 4),
        copy_bytes=2**26 if tiny else 2**30,
        engine_args=engine_args,
        out=args.out,
        time_limit_s=args.time_limit_s,
        transformers=not args.skip_transformers,
    )
    if not 1 <= settings.min_len <= settings.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    return settings


# --------------------------------------------------------------------------- workload


def workload_lengths(settings: Settings) -> tuple[list[int], list[int]]:
    """Prompt and output lengths, each uniform in [min_len, max_len]; the same for every model."""
    rng = np.random.default_rng(settings.seed)
    low, high, size = settings.min_len, settings.max_len, settings.num_requests
    prompt_lens = rng.integers(low, high, size=size, endpoint=True).tolist()
    output_lens = rng.integers(low, high, size=size, endpoint=True).tolist()
    return prompt_lens, output_lens


def random_prompts(lengths: list[int], model: Record, seed: int) -> list[list[int]]:
    """Token ids drawn from the base vocabulary less the special tokens."""
    allowed = np.setdiff1d(np.arange(model["prompt_vocab_size"]), model["special_ids"])
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, len(allowed), size=n)].tolist() for n in lengths]


def decode_plan(batches: list[int], context: int, steps: int, budget: int) -> list[Record]:
    """Per batch size: the prompt length that puts the timed steps' mean context at `context`,
    and a max_tokens that no sequence reaches while timed (in a chunked prefill of `budget` tokens a
    step, the first prompts done decode up to one token per remaining prefill step before the last
    one has its first)."""
    prompt_len = max(1, context - 1 - (steps - 1) // 2)
    return [
        {
            "batch": b,
            "prompt_len": prompt_len,
            "steps": steps,
            "max_tokens": steps + math.ceil(b * prompt_len / budget) + 8,
        }
        for b in batches
    ]


# --------------------------------------------------------------------------- stages


class Stages:
    """Runs each stage in a worker process, under what is left of the time limit."""

    def __init__(
        self,
        workdir: Path,
        time_limit_s: float | None,
        count: int,
        worker: str = "bench.gpu.gpu_bench_worker",
    ) -> None:
        self.workdir = workdir
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.left = count
        self.worker = worker
        self.log: list[Record] = []

    def next_budget(self) -> float | None:
        """Seconds the next stage may take (None: no limit; 0: none left), keeping RESERVE_S for each
        stage after it. Every stage, run here or by the caller, takes its budget from here."""
        self.left -= 1
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return 0.0
        return max(remaining - RESERVE_S * self.left, min(remaining, RESERVE_S))

    def run(self, name: str, task: Record) -> tuple[Record, str | None]:
        """The worker's parts, and why the worker stopped short (None when it ran to the end)."""
        timeout = self.next_budget()
        if timeout == 0.0:
            self.log.append({"stage": name, "seconds": 0.0, "status": "skipped"})
            return {}, "skipped: time limit reached"
        task_file, result_file = (
            self.workdir / f"{name}.task.json",
            self.workdir / f"{name}.result.json",
        )
        task_file.write_text(json.dumps(task))
        print(
            f"--- {name}" + (f" (at most {timeout:.0f} s)" if timeout is not None else ""),
            flush=True,
        )
        start = time.monotonic()
        cmd = [sys.executable, "-m", self.worker, str(task_file), str(result_file)]
        try:
            code = subprocess.run(cmd, cwd=REPO, timeout=timeout).returncode
            stopped = None if code == 0 else f"failed: worker exited with code {code}"
        except subprocess.TimeoutExpired:
            stopped = f"failed: timed out after {timeout:.0f} s"
        seconds = time.monotonic() - start
        parts = json.loads(result_file.read_text()) if result_file.exists() else {}
        if "error" in parts:
            stopped = f"failed: {parts.pop('error')}"
        self.log.append({"stage": name, "seconds": seconds, "status": stopped or "ok"})
        print(f"--- {name}: {stopped or 'ok'} in {seconds:.1f} s", flush=True)
        return parts, stopped


def part(parts: Record, key: str, stopped: str | None) -> Record:
    """A part of a worker's result; one it never reached carries the reason the worker stopped."""
    return parts.get(key) or {"status": stopped or "failed: not recorded"}


def run_model(
    stages: Stages,
    settings: Settings,
    name: str,
    model: Record,
    lengths: tuple[list[int], list[int]],
) -> Record:
    prompt_lens, output_lens = lengths
    # Each model's own prompts, the same whichever --models run with it.
    prompts = random_prompts(prompt_lens, model, settings.seed + 1 + list(SPECS).index(name))
    spec = SPECS[name]
    plans = (
        decode_plan(
            settings.decode_batches,
            settings.decode_context,
            settings.decode_steps,
            int(settings.engine_args["max_num_batched_tokens"]),
        )
        if name == "qwen3-0.6b"
        else []
    )
    longest = max([settings.max_len * 2] + [p["prompt_len"] + p["max_tokens"] for p in plans])
    warmup = {"warmup_prompt_len": 4 if settings.tiny else 32, "warmup_output_len": 4}
    paged, stopped = stages.run(
        f"pagedserve-{name}",
        {
            "kind": "pagedserve",
            "model_dir": model["folder"],
            "device": settings.device,
            "tiny": settings.tiny,
            "prompts": prompts,
            "output_lens": output_lens,
            "engine_args": {**settings.engine_args, "max_model_len": longest},
            **warmup,
            "decode": {"plans": plans, "copy_bytes": settings.copy_bytes} if plans else None,
        },
    )
    result: Record = {"pagedserve": part(paged, "throughput", stopped)}
    if plans:
        result["bandwidth"] = part(paged, "bandwidth", stopped)
        result["decode"] = [
            {"batch": p["batch"], **part(paged, f"decode_{p['batch']}", stopped)} for p in plans
        ]
    batch_size = spec.tiny_hf_batch_size if settings.tiny else spec.hf_batch_size
    if not settings.transformers:
        skipped = {"status": "skipped: --skip-transformers"}
        result["transformers_static"] = {"batch_size": batch_size, **skipped}
        result["transformers_generate_batch"] = skipped
        return result
    # The tiny run times every request, so that the static loop runs more than one batch.
    count = min(
        settings.num_requests,
        settings.hf_requests or (settings.num_requests if settings.tiny else batch_size),
    )
    hf, stopped = stages.run(
        f"transformers-{name}",
        {
            "kind": "transformers",
            "model_dir": model["folder"],
            "device": settings.device,
            "dtype": settings.dtype,
            "prompts": prompts[:count],
            "output_lens": output_lens[:count],
            "batch_size": batch_size,
            "tiny": settings.tiny,
            **warmup,
        },
    )
    result["transformers_static"] = {"batch_size": batch_size, **part(hf, "static", stopped)}
    result["transformers_generate_batch"] = part(hf, "generate_batch", stopped)
    return result


def decode_rows(model: Record, result: Record) -> list[Record]:
    """Each decode measurement with its floor: a decode step reads every weight and the KV of every
    sequence's context once; floor = those bytes / copy bandwidth (bytes read + written per second)."""
    bandwidth = result["bandwidth"]
    rows = []
    for measured in result["decode"]:
        if measured["status"] != "ok" or bandwidth["status"] != "ok":
            rows.append(measured)
            continue
        bytes_read = (
            model["weight_bytes"]
            + measured["batch"] * measured["mean_context"] * model["kv_bytes_per_token"]
        )
        floor_s = bytes_read / bandwidth["bytes_per_s"]
        rows.append(
            {
                **measured,
                "bytes_read": bytes_read,
                "floor_s": floor_s,
                "ratio": measured["step_s"] / floor_s,
            }
        )
    return rows


# --------------------------------------------------------------------------- report


def fmt_rate(r: Record) -> str:
    return (
        f"{r['output_tok_s']:.1f}" if r["status"] == "ok" else r["status"][:100].replace("|", "/")
    )


def markdown(report: Record) -> str:
    meta, env = report["meta"], report["environment"]
    s: Record = meta["settings"]
    lines = [
        f"## GPU benchmark, {meta['date']}, {env.get('device_name', '?')}",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, transformers "
        f"{env.get('transformers')}, Python {env.get('python')}. Command: `{meta['command']}`",
        "",
        f"{s['num_requests']} requests, prompt and output lengths each uniform in [{s['min_len']}, {s['max_len']}] "
        f"(seed {s['seed']}), random token ids, greedy, EOS ignored; random-weight {s['dtype']} models, real "
        "tokenizers. pagedserve: all requests in one `LLM.generate` (max_num_seqs 256, max_num_batched_tokens 8192, "
        "prefix caching off). transformers (sdpa): `generate` in static left-padded batches in workload order, "
        "each until its longest request ends, and `generate_batch` with every request running to the longest "
        "output, both on the first N requests only (a random subset: lengths are drawn independently). Output "
        "tok/s counts only the tokens each request asked for; ratio is to transformers `generate`.",
        "",
        "| model | system | requests | out tok/s | total tok/s | ratio to transformers |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, result in report["models"].items():
        label = SPECS[name].label
        static = result["transformers_static"]
        systems = [
            ("pagedserve", result["pagedserve"]),
            (f"transformers generate, batches of {static.get('batch_size', '?')}", static),
            ("transformers generate_batch", result["transformers_generate_batch"]),
        ]
        for system, r in systems:
            ok = r["status"] == "ok"
            ratio = (
                f"{r['output_tok_s'] / static['output_tok_s']:.2f}x"
                if ok and static["status"] == "ok"
                else "-"
            )
            total = f"{r['total_tok_s']:.1f}" if ok else "-"
            lines.append(
                f"| {label} | {system} | {r.get('requests', '-')} | {fmt_rate(r)} | {total} | {ratio} |"
            )
    for name, result in report["models"].items():
        engine = result["pagedserve"].get("engine")
        if engine:
            sizes = engine["cuda_graph_batch_sizes"]
            graphs = (
                f"decode CUDA graphs for {len(sizes)} batch sizes up to {max(sizes)}"
                if sizes
                else "no CUDA graphs"
            )
            lines.append(
                f"\npagedserve on the {SPECS[name].label}: KV pool {engine['kv_blocks']} blocks x "
                f"{engine['block_size']} tokens, max_model_len {engine['max_model_len']}, "
                f"{engine['attention_backend']}, {graphs}, loaded in {result['pagedserve']['load_s']:.1f} s."
            )
        if any(
            r["status"] == "ok" and r["output_tokens"] != r["requested_tokens"]
            for r in (
                result["pagedserve"],
                result["transformers_static"],
                result["transformers_generate_batch"],
            )
        ):
            lines.append(
                f"\n**{SPECS[name].label}: a system produced other token counts than requested (see JSON).**"
            )
        gb = result["transformers_generate_batch"]
        if gb["status"] == "ok":
            lines.append(
                f"\ngenerate_batch on the {SPECS[name].label}: timed from {gb['timed_from']} "
                f"({gb['seconds']:.1f} s; the whole call took {gb['call_s']:.1f} s)."
            )
    for name, result in report["models"].items():
        if "decode" not in result:
            continue
        bw = result["bandwidth"]
        bw_text = f"{bw['bytes_per_s'] / 1e9:.0f} GB/s" if bw["status"] == "ok" else bw["status"]
        lines += [
            "",
            f"Decode step, pagedserve, {SPECS[name].label}: mean of {s['decode_steps']} `engine.step()` calls with every "
            f"sequence decoding. floor = (weights + each sequence's KV read once) / bandwidth, bandwidth = bytes read "
            f"+ bytes written per second of a {s['copy_bytes'] / 2**30:g} GiB device-to-device copy = {bw_text}.",
            "",
            "| batch | mean context | GB read | step ms | floor ms | step / floor |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["decode_rows"]:
            if row["status"] != "ok":
                lines.append(
                    f"| {row['batch']} | - | - | {row['status'][:100].replace('|', '/')} | - | - |"
                )
            elif "floor_s" not in row:  # the bandwidth was not measured: no floor
                lines.append(
                    f"| {row['batch']} | {row['mean_context']:.0f} | - | {row['step_s'] * 1e3:.2f} | - | - |"
                )
            else:
                lines.append(
                    f"| {row['batch']} | {row['mean_context']:.0f} | {row['bytes_read'] / 1e9:.2f} | "
                    f"{row['step_s'] * 1e3:.2f} | {row['floor_s'] * 1e3:.3f} | {row['ratio']:.1f}x |"
                )
    return "\n".join(lines) + "\n"


def failures(report: Record) -> list[str]:
    """What must work: every pagedserve and transformers-generate measurement (not generate_batch)."""
    bad = []
    for name, result in report["models"].items():
        checked = [
            ("pagedserve", result["pagedserve"]),
            ("transformers generate", result["transformers_static"]),
        ]
        if "decode_rows" in result:
            checked += [("copy bandwidth", result["bandwidth"])]
            checked += [(f"decode batch {r['batch']}", r) for r in result["decode_rows"]]
        bad += [
            f"{name} {what}: {r['status']}"
            for what, r in checked
            if r["status"] != "ok" and not r["status"].startswith("skipped: --skip")
        ]
    return bad


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    report: Record = {
        "meta": {
            "date": started,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "settings": settings.__dict__,
        },
        "models": {},
    }
    lengths = workload_lengths(settings)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        per_model = 2 if settings.transformers else 1
        stages = Stages(Path(tmp), settings.time_limit_s, 1 + per_model * len(settings.models))
        built, stopped = stages.run(
            "build",
            {
                "kind": "build",
                "models": settings.models,
                "root": tmp,
                "device": settings.device,
                "dtype": settings.dtype,
                "tiny": settings.tiny,
                "seed": settings.seed,
            },
        )
        report["environment"] = part(built, "environment", stopped)
        for name in settings.models:
            model = part(built, name, stopped)
            report["models"][name] = {"model": model}
            if model["status"] != "ok":
                failed = {"status": model["status"]}
                report["models"][name].update(
                    pagedserve=failed,
                    transformers_static=failed,
                    transformers_generate_batch=failed,
                )
                continue
            result = run_model(stages, settings, name, model, lengths)
            if "decode" in result:
                result["decode_rows"] = decode_rows(model, result)
            report["models"][name].update(result)
        report["stages"] = stages.log
    report["workload"] = {"prompt_lens": lengths[0], "output_lens": lengths[1]}
    report["markdown"] = markdown(report)
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(json.dumps(report, indent=1, default=str))
    settings.out.with_suffix(".md").write_text(report["markdown"])
    print(report["markdown"])
    bad = failures(report)
    for line in bad:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
