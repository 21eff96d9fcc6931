"""The server on a GPU: start-up time, then a streamed load over loopback against the offline
engine on the very same workload.

    python bench/gpu/gpu_serve.py --out-dir DIR [--model qwen3-0.6b] [--concurrency 64]
        [--num-requests 256] [--input-len 512] [--output-len 128] [--port 8123] [serve flags...]

1. builds the random-weight model (bench/gpu/gpu_bench_models.py) in a temporary folder;
2. starts `pagedserve serve` on it (bfloat16, `--max-num-seqs` = the concurrency, plus any flags
   given after ours) and times the start: process spawned -> `GET /health` answers 200;
3. runs bench/serving/serve_load.py's closed loop (`--concurrency` streams, greedy, EOS ignored);
4. stops the server with SIGTERM (it must drain and exit 0 within 30 s);
5. runs bench/serving/offline_same_workload.py with the same engine flags and workload.

Writes DIR/gpu_serve.json (everything) and DIR/gpu_serve.md (the table, also printed). Exits 1
when a step failed; the steps after a failed one still run where they can.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVING = REPO / "bench" / "serving"
sys.path.insert(0, str(REPO))

Record = dict[str, object]


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float) -> float | None:
    """Seconds until `url` answers 200, None if the process died or the limit passed."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.2)
    return None


def run_json(cmd: list[str], out: Path, limit_s: float) -> Record:
    """Run a benchmark script that writes JSON to `out`; its report, or why there is none."""
    print("+", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, cwd=REPO, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over {limit_s:.0f} s"}
    if rc != 0 or not out.exists():
        return {"status": f"failed: exit {rc}"}
    return {"status": "ok", **json.loads(out.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--start-limit-s", type=float, default=240)
    parser.add_argument("--load-limit-s", type=float, default=180)
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU smoke run: 2-layer model, float32, on the CPU"
    )
    args, serve_flags = parser.parse_known_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from bench.gpu.gpu_bench_models import build

    report: Record = {"settings": {**vars(args), "out_dir": str(args.out_dir)}}
    report["settings"]["serve_flags"] = serve_flags  # type: ignore[index]
    with tempfile.TemporaryDirectory(prefix="gpu-serve-") as tmp:
        folder = Path(tmp) / args.model
        device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
        model = build(args.model, folder, device, getattr(torch, dtype), args.tiny, 0)
        report["model"] = model
        engine_flags = [
            "--device", device, "--dtype", dtype,
            "--max-num-seqs", str(args.concurrency), *serve_flags,
        ]  # fmt: skip
        workload = [
            "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--vocab-size", str(model["prompt_vocab_size"]),
        ]  # fmt: skip
        serve_cmd = [
            sys.executable, "-m", "server.cli", "serve", str(folder),
            "--host", "127.0.0.1", "--port", str(args.port), *engine_flags,
        ]  # fmt: skip
        print("+", " ".join(serve_cmd), flush=True)
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        server = subprocess.Popen(serve_cmd, cwd=REPO, env=env)
        base = f"http://127.0.0.1:{args.port}"
        try:
            started = wait_healthy(f"{base}/health", server, args.start_limit_s)
            report["start_s"] = started
            if started is None:
                report["serve"] = {"status": "failed: the server did not become healthy"}
            else:
                print(f"server healthy after {started:.1f} s", flush=True)
                out = args.out_dir / "serve_load.json"
                report["serve"] = run_json(
                    [sys.executable, str(SERVING / "serve_load.py"), "--base-url", base,
                     "--concurrency", str(args.concurrency), "--timeout", str(args.load_limit_s),
                     *workload, "--out", str(out)],
                    out, args.load_limit_s + 30,
                )  # fmt: skip
        finally:
            stop = time.perf_counter()
            server.send_signal(signal.SIGTERM)
            try:
                report["drain"] = {"exit": server.wait(30), "s": time.perf_counter() - stop}
            except subprocess.TimeoutExpired:
                server.kill()
                report["drain"] = {"exit": "killed after 30 s"}
        out = args.out_dir / "offline.json"
        report["offline"] = run_json(
            [sys.executable, str(SERVING / "offline_same_workload.py"), str(folder), *engine_flags,
             *workload, "--out", str(out)],
            out, args.load_limit_s + 120,
        )  # fmt: skip
    (args.out_dir / "gpu_serve.json").write_text(json.dumps(report, indent=1, default=str))
    table = markdown(report)
    (args.out_dir / "gpu_serve.md").write_text(table)
    print(table)
    ok = (
        report["start_s"] is not None
        and report["serve"].get("status") == "ok"  # type: ignore[union-attr]
        and report["offline"].get("status") == "ok"  # type: ignore[union-attr]
        and report["drain"].get("exit") == 0  # type: ignore[union-attr]
    )
    return 0 if ok else 1


def _get(record: object, *keys: str) -> object:
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record


def markdown(report: Record) -> str:
    s = report["settings"]
    serve, offline = report["serve"], report["offline"]
    lines = [
        f"Server vs offline engine, {s['model']} shape (random weights, bf16), "  # type: ignore[index]
        f"{s['num_requests']} requests of {s['input_len']} in / {s['output_len']} out, "  # type: ignore[index]
        f"closed loop of {s['concurrency']} streams; extra serve flags: {s['serve_flags'] or 'none'}",  # type: ignore[index]
        "",
        f"- start-up (spawn -> /health 200): {report['start_s']}",
        f"- SIGTERM drain: {report['drain']}",
        f"- server: {serve.get('status')}, offline: {offline.get('status')}",  # type: ignore[union-attr]
        f"- completed / failed / length mismatches: {_get(serve, 'completed')} / "
        f"{_get(serve, 'failed')} / {_get(serve, 'length_mismatches')} (server), "
        f"{_get(offline, 'length_mismatches')} (offline)",
    ]
    served, alone = _get(serve, "output_throughput"), _get(offline, "output_throughput")
    if isinstance(served, float) and isinstance(alone, float):
        lines.append(
            f"- output tok/s: server {served:.0f}, offline {alone:.0f}, ratio {served / alone:.2f}"
        )
    for name in ("ttft", "itl", "tpot"):
        stats = _get(serve, name)
        if isinstance(stats, dict):
            lines.append(
                f"- {name.upper()} ms: mean {stats.get('mean_ms', 0):.1f}, p50 {stats.get('p50_ms', 0):.1f}, p99 {stats.get('p99_ms', 0):.1f}"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
