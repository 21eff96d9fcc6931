"""bench/gpu/gpu_bench.py --tiny end to end on the CPU: every code path of the GPU benchmark but the
CUDA-only ones (a CPU copy stands in for the device copy), in its worker processes. And
bench/gpu/gpu_check.sh at least parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_bench_tiny_runs_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "gpu_bench.json"
    proc = subprocess.run(
        # One model: the second runs the same code on another shape, for twice the time.
        [
            sys.executable,
            "bench/gpu/gpu_bench.py",
            "--tiny",
            "--models",
            "qwen3-0.6b",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {"meta", "environment", "models", "stages", "workload", "markdown"} <= report.keys()
    assert [s["status"] for s in report["stages"]] == ["ok"] * 3  # environment, then two per model
    assert set(report["models"]) == {"qwen3-0.6b"}
    for name, model in report["models"].items():
        assert model["model"]["weight_bytes"] > 0 and model["model"]["kv_bytes_per_token"] > 0
        for system in ("pagedserve", "transformers_static", "transformers_generate_batch"):
            result = model[system]
            assert result["status"] == "ok", (name, system, result["status"])
            assert result["output_tok_s"] > 0 and result["total_tok_s"] > result["output_tok_s"]
            # Greedy with EOS ignored: every request gets exactly the tokens it asked for.
            assert result["output_tokens"] == result["requested_tokens"], (name, system)
        assert model["pagedserve"]["requests"] == 8
        assert model["pagedserve"]["requested_tokens"] == report["workload"]["output_lens"]
        assert model["transformers_static"]["requests"] == 8  # two static batches of 4
    decode = report["models"]["qwen3-0.6b"]["decode_rows"]
    assert [row["batch"] for row in decode] == [1, 4]
    for row in decode:
        assert row["status"] == "ok" and row["step_s"] > 0 and row["floor_s"] > 0
        assert row["ratio"] == row["step_s"] / row["floor_s"]
    assert report["models"]["qwen3-0.6b"]["bandwidth"]["bytes_per_s"] > 0
    markdown = out.with_suffix(".md").read_text()
    assert markdown == report["markdown"] and markdown in proc.stdout
    assert (
        "| model | system | requests | out tok/s |" in markdown
        and "| batch | mean context |" in markdown
    )


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", "bench/gpu/gpu_check.sh"], cwd=REPO, check=True)
