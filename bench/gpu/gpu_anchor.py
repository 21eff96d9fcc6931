"""The anchor workload on a GPU, offline and served, with the decode step and its kernels, into one
JSON file that a partial run still writes.

    python bench/gpu/gpu_anchor.py [--results-dir bench/results] [--time-limit-s 240]   # on a CUDA machine
    python bench/gpu/gpu_anchor.py --tiny --results-dir /tmp/dry                          # the CPU dry run

The workload is the one users quote vLLM on (`vllm bench throughput`, random 512 in / 128 out):
--num-prompts (1,000) prompts of --input-len (512) random token ids, each asking for exactly
--output-len (128) tokens (greedy, EOS ignored), on random weights in the shape of Qwen3-0.6B, bf16.

1. build: the model, saved once into a temporary folder (bench/gpu/gpu_bench_models.py);
2. offline (a process of its own): every prompt submitted at once to one `LLM.generate`; then
   kernels per decode step at --kernel-batch (bench/cpu/decode_kernels.py), then the decode-step table
   (mean `engine.step()` at each --decode-batches, against the floor of weights + KV read once at
   the measured copy bandwidth), on the same engine;
3. server: `pagedserve serve` with the same engine flags, the same prompts streamed by a closed
   loop of --concurrency (256) clients (bench/serving/serve_load.py), then SIGTERM;
4. kernel variants (--kernel-variant, each a process of its own): the decode step's kernels again
   with other engine arguments or environment; by default with the fused Triton kernels off.

Writes RESULTS_DIR/gpu-<date>-<gpu>.json (the keys: `assemble`) and prints its summary. Each part
that failed or ran out of time is null with a line in `errors`; exits 1 when there is any.
--tiny runs the same code on the CPU: a 2-layer model, float32, 16 prompts of 16 in / 8 out, the
kernel count then counts CPU operators (`kernels_per_decode_step` null).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: `bench.*` comes from this checkout
sys.path.insert(0, str(REPO / "bench" / "serving"))  # serve_load and its own imports

from bench.cpu.decode_kernels import kernels_per_step  # noqa: E402
from bench.gpu.gpu_bench import Stages, decode_plan, decode_rows, part  # noqa: E402
from bench.gpu.gpu_serve import wait_healthy  # noqa: E402

Record = dict[str, object]
MODEL = "qwen3-0.6b"
# The kernel count's second run: the fused Triton kernels (on by default) turned off.
DEFAULT_VARIANTS: dict[str, Record] = {"unfused": {"engine_args": {"fused_kernels": False}}}
# What users compare with: vLLM 0.19 `bench throughput` on one H100, this workload.
VLLM_REFERENCE = {"version": "0.19", "gpu": "H100", "out_tok_s": 12_100.0, "req_s": 95.0}


@dataclass(frozen=True)
class Settings:
    tiny: bool
    device: str
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    warmup: int
    seed: int
    decode_batches: list[int]
    decode_context: int
    decode_steps: int
    kernel_batch: int
    copy_bytes: int
    engine_args: Record
    kernel_variants: dict[str, Record]
    results_dir: Path
    time_limit_s: float | None
    commit: str | None


def parse_variant(text: str) -> tuple[str, Record]:
    """NAME=JSON, the JSON an object of `engine_args` (merged into the anchor's) and/or `env`."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON, got {text!r}")
    variant = json.loads(spec)
    if not isinstance(variant, dict) or set(variant) - {"engine_args", "env"}:
        raise argparse.ArgumentTypeError(f"{name}: keys are engine_args and env, got {spec}")
    return name, variant


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run (see above)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 1000 (16)")
    parser.add_argument("--input-len", type=int, default=None, help="default 512 (16)")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (8)")
    parser.add_argument("--concurrency", type=int, default=None, help="streams (256; 8)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-batches", default="1,8,64,256")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed steps (32; 4)")
    parser.add_argument("--kernel-batch", type=int, default=8)
    parser.add_argument(
        "--kernel-variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="count the decode kernels again under other settings (repeatable; default: "
        f"{' '.join(f'{k}={json.dumps(v)}' for k, v in DEFAULT_VARIANTS.items())})",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an engine argument for offline and server alike, e.g. attention_backend='\"triton\"'",
    )
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument("--time-limit-s", type=float, default=None)
    parser.add_argument("--commit", default=None, help="default: git rev-parse HEAD, when a repo")
    args = parser.parse_args(argv)
    tiny = args.tiny

    def pick(value, full, small):
        return value if value is not None else (small if tiny else full)

    device = "cpu" if tiny else "cuda"
    input_len, output_len = pick(args.input_len, 512, 16), pick(args.output_len, 128, 8)
    decode_batches = [int(b) for b in args.decode_batches.split(",")]
    decode_context = input_len
    engine_args: Record = {
        "device": device,
        "dtype": "float32" if tiny else "bfloat16",
        "enable_prefix_caching": False,  # random prompts share no prefix: hashing would be all cost
        "max_num_seqs": max([pick(args.concurrency, 256, 8), *decode_batches, args.kernel_batch]),
        "max_num_batched_tokens": 8192,
        "fused_kernels": True,  # the default, named: the main kernel count is with them
    }
    if tiny:  # the CPU default pool (1 GiB) takes longer to allocate than the dry run takes
        engine_args["num_kv_blocks"] = 1024
    for text in args.engine_arg:
        name, _, value = text.partition("=")
        engine_args[name] = json.loads(value)
    return Settings(
        tiny=tiny,
        device=device,
        num_prompts=pick(args.num_prompts, 1000, 16),
        input_len=input_len,
        output_len=output_len,
        concurrency=pick(args.concurrency, 256, 8),
        warmup=args.warmup,
        seed=args.seed,
        decode_batches=decode_batches,
        decode_context=decode_context,
        decode_steps=pick(args.decode_steps, 32, 4),
        kernel_batch=args.kernel_batch,
        copy_bytes=2**26 if tiny else 2**30,
        engine_args=engine_args,
        kernel_variants=dict(args.kernel_variant) or DEFAULT_VARIANTS,
        results_dir=args.results_dir or REPO / "bench" / ("out" if tiny else "results"),
        time_limit_s=args.time_limit_s,
        commit=args.commit or git_commit(),
    )


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# --------------------------------------------------------------------------- server


def cli_flags(engine_args: Record) -> list[str]:
    """`pagedserve serve` flags for LLM keyword arguments (the same names, in kebab case)."""
    flags: list[str] = []
    for name, value in engine_args.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


DRAIN_S = 30  # SIGTERM -> exit, kept out of the load's time


def serve(s: Settings, model: Record, engine_args: Record, budget_s: float) -> Record:
    """Start the server on the built model, stream the workload through it, stop it."""
    from serve_load import run_load

    start = time.monotonic()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "server.cli", "serve", str(model["folder"]),
        "--host", "127.0.0.1", "--port", str(port), *cli_flags(engine_args),
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    server = subprocess.Popen(cmd, cwd=REPO, env=env)
    record: Record = {"command": " ".join(cmd)}
    try:
        started = wait_healthy(f"{base}/health", server, budget_s - DRAIN_S)
        record["start_s"] = started
        if started is None:
            record["status"] = "failed: the server did not answer /health in time"
        else:
            load_s = budget_s - DRAIN_S - (time.monotonic() - start)
            report = asyncio.run(
                run_load(
                    base_url=base,
                    num_requests=s.num_prompts,
                    concurrency=s.concurrency,
                    input_len=s.input_len,
                    output_len=s.output_len,
                    vocab_size=int(model["prompt_vocab_size"]),
                    seed=s.seed,
                    timeout=max(load_s, 1.0),
                    warmup=s.warmup,
                    keep_requests=False,
                )
            )
            record.update(report)
            if report["completed"] == 0:
                first = next(iter(report["errors"]), "no reason given")
                record["status"] = f"failed: no request completed ({first})"
            else:
                record["status"] = "ok"
    finally:
        stop = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            record["drain"] = {"exit": server.wait(DRAIN_S), "s": time.monotonic() - stop}
        except subprocess.TimeoutExpired:
            server.kill()
            record["drain"] = {"exit": f"killed after {DRAIN_S} s"}
    return record


# --------------------------------------------------------------------------- report


def ok(record: object) -> bool:
    return isinstance(record, dict) and record.get("status") == "ok"


def assemble(s: Settings, engine_args: Record, parts: dict[str, Record]) -> Record:
    """The run's JSON from its parts (each a dict with a `status`; a missing one counts as failed):
    a part that did not run or failed is null, with its reason in `errors`."""
    errors: list[str] = []

    def get(name: str) -> Record | None:
        record = parts.get(name) or {"status": "failed: not recorded"}
        if ok(record):
            return record
        errors.append(f"{name}: {record.get('status')}")
        return None

    env, model, offline, serve = (get(n) for n in ("environment", "model", "offline", "serve"))
    bandwidth = get("bandwidth")
    decode = [
        {"batch": b, **(get(f"decode_{b}") or {"status": "failed"})} for b in s.decode_batches
    ]
    rows = decode_rows(model, {"bandwidth": bandwidth or {"status": "failed"}, "decode": decode})

    def rate(record: Record | None, key: str) -> float | None:
        return float(record[key]) if record is not None else None

    offline_tok_s, server_tok_s = (
        rate(offline, "output_throughput"),
        rate(serve, "output_throughput"),
    )
    for name, record in (("offline", offline), ("serve", serve)):
        if record is not None and (record.get("length_mismatches") or record.get("failed")):
            errors.append(
                f"{name}: {record.get('failed', 0)} failed, {record['length_mismatches']} requests "
                "with another token count than asked"
            )
    drain = (parts.get("serve") or {}).get("drain")
    if isinstance(drain, dict) and drain.get("exit") != 0:
        errors.append(f"serve: the server's SIGTERM drain ended with {drain.get('exit')}")
    count = get("kernels")
    kernels, counted, top = kernels_per_step(count) if count is not None else (None, "failed", [])
    variants = {}
    for name in s.kernel_variants:
        record = get(f"kernels:{name}")
        n, how, _ = kernels_per_step(record) if record is not None else (None, "failed", [])
        variants[name] = {
            **s.kernel_variants[name],
            "kernels_per_decode_step": n,
            "counted": how,
            "cpu_ops_per_decode_step": (record or {}).get("cpu_ops"),
        }
    engine = offline["engine"] if offline is not None else {}
    return {
        "gpu": "cpu (dry run)" if s.tiny else (env or {}).get("device_name"),
        "commit": s.commit,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "dry_run": s.tiny,
        "workload": {
            "model": f"{MODEL} shape, random weights, {engine_args['dtype']}",
            "prompts": s.num_prompts,
            "input_len": s.input_len,
            "output_len": s.output_len,
            "server_concurrency": s.concurrency,
            "seed": s.seed,
        },
        "offline_out_tok_s_512_128": offline_tok_s,
        "offline_req_s_512_128": rate(offline, "request_throughput"),
        "server_out_tok_s_512_128": server_tok_s,
        "server_req_s_512_128": rate(serve, "request_throughput"),
        "server_over_offline": (
            server_tok_s / offline_tok_s if server_tok_s and offline_tok_s else None
        ),
        "vllm_reference": VLLM_REFERENCE,
        "offline_over_vllm_reference": (
            offline_tok_s / VLLM_REFERENCE["out_tok_s"] if offline_tok_s else None
        ),
        "step_ms": {str(r["batch"]): r["step_s"] * 1e3 if ok(r) else None for r in rows},
        "floor_ms": {str(r["batch"]): r["floor_s"] * 1e3 if "floor_s" in r else None for r in rows},
        "copy_bandwidth_gb_s": bandwidth["bytes_per_s"] / 1e9 if bandwidth else None,
        "kernels_per_decode_step": kernels,
        "kernels_counted": counted,
        "kernels_per_decode_step_eager": (count or {}).get("eager", {}).get("kernels"),
        "cpu_ops_per_decode_step": (count or {}).get("cpu_ops"),
        "kernel_batch": s.kernel_batch,
        "kernel_top": top,
        "kernel_variants": variants,
        "attention_backend": engine.get("attention_backend"),
        "cuda_graph_batch_sizes": engine.get("cuda_graph_batch_sizes"),
        "kv_blocks": engine.get("kv_blocks"),
        "engine_args": engine_args,
        "server": {
            k: (serve or {}).get(k)
            for k in ("start_s", "completed", "failed", "ttft", "itl", "tpot", "drain")
        },
        "environment": env,
        "decode_rows": rows,
        "errors": errors,
    }


def finite(value: object) -> object:
    """`value` with every NaN or infinity (a latency of no requests) made null: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def summary(report: Record) -> str:
    def num(value: object, fmt: str = ",.0f") -> str:
        return "null" if value is None else format(value, fmt)

    workload = report["workload"]
    lines = [
        f"== {report['gpu']} at {report['commit']}: {workload['prompts']} prompts of "
        f"{workload['input_len']} in / {workload['output_len']} out, {report['attention_backend']}",
        f"offline {num(report['offline_out_tok_s_512_128'])} out tok/s "
        f"({num(report['offline_req_s_512_128'], '.1f')} req/s); server at "
        f"{workload['server_concurrency']} streams {num(report['server_out_tok_s_512_128'])} "
        f"out tok/s; server / offline {num(report['server_over_offline'], '.2f')}",
        f"kernels per decode step at batch {report['kernel_batch']}: "
        f"{report['kernels_per_decode_step']} ({report['kernels_counted']})",
    ]
    for name, variant in report["kernel_variants"].items():
        lines.append(f"  {name}: {variant['kernels_per_decode_step']} ({variant['counted']})")
    for batch, step in report["step_ms"].items():
        floor = report["floor_ms"][batch]
        lines.append(f"batch {batch:>4}: step {num(step, '.2f')} ms, floor {num(floor, '.3f')} ms")
    lines += [f"ERROR {e}" for e in report["errors"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    plans = decode_plan(
        s.decode_batches, s.decode_context, s.decode_steps,
        int(s.engine_args["max_num_batched_tokens"]),
    )  # fmt: skip
    # The workload, the decode table's prompts with their tokens, the kernel count's (under 64).
    longest = max(
        [s.input_len + s.output_len, 64] + [p["prompt_len"] + p["max_tokens"] for p in plans]
    )
    engine_args = {**s.engine_args, "max_model_len": longest}
    parts: dict[str, Record] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-anchor-") as tmp:
        stages = Stages(
            Path(tmp),
            s.time_limit_s,
            3 + len(s.kernel_variants),
            worker="bench.gpu.gpu_anchor_worker",
        )
        built, stopped = stages.run(
            "build",
            {
                "kind": "build", "models": [MODEL], "root": tmp, "device": s.device,
                "dtype": engine_args["dtype"], "tiny": s.tiny, "seed": s.seed,
            },
        )  # fmt: skip
        parts["environment"] = part(built, "environment", stopped)
        model = parts["model"] = part(built, MODEL, stopped)
        if ok(model):
            run_engine_stages(s, stages, model, engine_args, plans, parts)
        parts_log = stages.log
    report = assemble(s, engine_args, parts)
    report["stages"] = parts_log
    s.results_dir.mkdir(parents=True, exist_ok=True)
    day = time.strftime("%Y-%m-%d")
    out = s.results_dir / f"gpu-{day}-{slug(str(report['gpu']))}.json"
    out.write_text(json.dumps(finite(report), indent=1, default=str, allow_nan=False) + "\n")
    print(summary(report))
    print(f"wrote {out}")
    return 1 if report["errors"] else 0


def run_engine_stages(
    s: Settings,
    stages: Stages,
    model: Record,
    engine_args: Record,
    plans: list[Record],
    parts: dict[str, Record],
) -> None:
    """The offline engine, the server and the kernel variants, each within its share of the time."""
    common = {"model_dir": model["folder"], "device": s.device, "tiny": s.tiny}
    anchor, stopped = stages.run(
        "offline",
        {
            **common,
            "kind": "anchor",
            "engine_args": engine_args,
            "workload": {
                "num_prompts": s.num_prompts, "input_len": s.input_len,
                "output_len": s.output_len, "vocab_size": model["prompt_vocab_size"],
                "seed": s.seed, "warmup": s.warmup,
            },
            "decode": {"plans": plans, "copy_bytes": s.copy_bytes},
            "kernel_batch": s.kernel_batch,
        },
    )  # fmt: skip
    for name in ["bandwidth", "offline", "kernels"] + [f"decode_{b}" for b in s.decode_batches]:
        parts[name] = part(anchor, name, stopped)
    budget = stages.next_budget()
    started = time.monotonic()
    print("--- serve" + (f" (at most {budget:.0f} s)" if budget is not None else ""), flush=True)
    if budget == 0.0:
        parts["serve"] = {"status": "skipped: time limit reached"}
    else:
        try:
            parts["serve"] = serve(s, model, engine_args, budget or 1800.0)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON; the variants still run
            parts["serve"] = {"status": f"failed: {type(exc).__name__}: {exc}"}
    stages.log.append(
        {
            "stage": "serve",
            "seconds": time.monotonic() - started,
            "status": parts["serve"]["status"],
        }
    )
    for name, variant in s.kernel_variants.items():
        counted, stopped = stages.run(
            f"kernels-{name}",
            {
                **common,
                "kind": "kernels",
                "engine_args": {**engine_args, **variant.get("engine_args", {})},
                "env": variant.get("env", {}),
                "kernel_batch": s.kernel_batch,
            },
        )
        parts[f"kernels:{name}"] = part(counted, "kernels", stopped)


if __name__ == "__main__":
    sys.exit(main())
