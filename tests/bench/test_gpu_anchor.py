"""The GPU check's anchor run (bench/gpu/gpu_anchor.py): its JSON from whole and partial parts, the
kernel count's choice of number, the server flags it derives, and the whole pipeline dry-run on
the CPU with a tiny model, so that every code path the GPU machine runs has run here first."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu.decode_kernels import kernels_per_step
from bench.gpu.gpu_anchor import assemble, cli_flags, finite, parse_args, slug
from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

BATCHES = ["1", "8", "64", "256"]
WEIGHT_BYTES, KV_PER_TOKEN, BANDWIDTH = 1_200_000_000, 114_688, 3.0e12


def full_parts() -> dict[str, dict]:
    """Every part of a run that went well, shaped as the workers and the load client write them."""
    parts: dict[str, dict] = {
        "environment": {"status": "ok", "device_name": "NVIDIA H100 80GB HBM3"},
        "model": {"status": "ok", "weight_bytes": WEIGHT_BYTES, "kv_bytes_per_token": KV_PER_TOKEN},
        "bandwidth": {"status": "ok", "bytes_per_s": BANDWIDTH},
        "offline": {
            "status": "ok",
            "output_throughput": 10_000.0,
            "request_throughput": 78.0,
            "length_mismatches": 0,
            "engine": {
                "attention_backend": "TritonBackend",
                "cuda_graph_batch_sizes": [1, 2, 4],
                "kv_blocks": 40_000,
            },
        },
        "serve": {
            "status": "ok",
            "output_throughput": 8_000.0,
            "request_throughput": 62.5,
            "completed": 1000,
            "failed": 0,
            "length_mismatches": 0,
            "ttft": {"mean_ms": float("nan")},
            "drain": {"exit": 0, "s": 1.5},
        },
        # Graph replays hid their kernels: the eager step's count is the one reported.
        "kernels": {
            "status": "ok",
            "cuda_graphs": True,
            "served": {"kernels": 0, "transfers": 2, "top": []},
            "eager": {"kernels": 397, "transfers": 3, "top": [["gemm", 196]]},
        },
    }
    # The default second count, fused kernels off: its graph replays did show their kernels (the
    # eager step's count is still the one reported).
    parts["kernels:unfused"] = {
        "status": "ok",
        "cuda_graphs": True,
        "served": {"kernels": 901, "transfers": 2, "top": []},
        "eager": {"kernels": 905, "transfers": 3, "top": []},
    }
    for i, batch in enumerate(BATCHES):
        parts[f"decode_{batch}"] = {
            "status": "ok",
            "batch": int(batch),
            "steps": 32,
            "mean_context": 512.0,
            "step_s": 0.004 * (i + 1),
        }
    return parts


def settings(*extra: str):
    return parse_args(["--commit", "abc123", *extra])


def test_a_whole_run_fills_every_key_with_its_type() -> None:
    s = settings()
    report = assemble(s, {**s.engine_args, "max_model_len": 640}, full_parts())
    assert report["errors"] == []
    assert (report["gpu"], report["commit"], report["dry_run"]) == (
        "NVIDIA H100 80GB HBM3",
        "abc123",
        False,
    )
    assert report["offline_out_tok_s_512_128"] == 10_000.0
    assert report["server_out_tok_s_512_128"] == 8_000.0
    assert report["server_over_offline"] == pytest.approx(0.8)
    assert report["offline_over_vllm_reference"] == pytest.approx(10_000 / 12_100)
    assert list(report["step_ms"]) == BATCHES and list(report["floor_ms"]) == BATCHES
    assert report["step_ms"]["64"] == pytest.approx(12.0)
    # floor = (weights + each sequence's KV read once) / bandwidth
    for batch in BATCHES:
        expected = (WEIGHT_BYTES + int(batch) * 512 * KV_PER_TOKEN) / BANDWIDTH * 1e3
        assert report["floor_ms"][batch] == pytest.approx(expected)
    assert report["kernels_per_decode_step"] == 397
    assert (
        report["kernels_counted"].startswith("eager step") and "0 seen" in report["kernels_counted"]
    )
    assert report["kernel_top"] == [["gemm", 196]]
    unfused = report["kernel_variants"]["unfused"]
    assert unfused["kernels_per_decode_step"] == 905  # the eager count, as for the fused step
    assert unfused["engine_args"] == {"fused_kernels": False}
    assert report["attention_backend"] == "TritonBackend"
    assert report["workload"]["prompts"] == 1000 and report["workload"]["input_len"] == 512
    # Strict JSON: the NaN of a latency over no requests becomes null.
    text = json.dumps(finite(report), allow_nan=False)
    assert json.loads(text)["server"]["ttft"]["mean_ms"] is None


def test_a_partial_run_keeps_what_it_measured_and_names_what_it_did_not() -> None:
    parts = full_parts()
    parts["serve"] = {"status": "failed: the server did not answer /health in time"}
    parts["bandwidth"] = {"status": "failed: OutOfMemoryError: CUDA out of memory"}
    del parts["decode_64"]
    parts["offline"]["length_mismatches"] = 3
    s = settings()
    report = assemble(s, s.engine_args, parts)
    assert report["server_out_tok_s_512_128"] is None
    assert report["server_over_offline"] is None
    assert report["offline_out_tok_s_512_128"] == 10_000.0  # still there
    assert report["step_ms"]["1"] == pytest.approx(4.0) and report["step_ms"]["64"] is None
    assert all(floor is None for floor in report["floor_ms"].values())  # no bandwidth, no floor
    errors = report["errors"]
    assert any(e.startswith("serve: failed: the server") for e in errors)
    assert any(e.startswith("bandwidth: failed: OutOfMemoryError") for e in errors)
    assert any(e.startswith("decode_64: failed") for e in errors)
    assert any(e.startswith("offline:") and "3 requests" in e for e in errors)
    assert len(errors) == 4


def test_nothing_measured_still_makes_a_report() -> None:
    s = settings("--kernel-variant", 'off={"env": {"SOME_SWITCH": "0"}}')
    report = assemble(s, s.engine_args, {"environment": {"status": "failed: no CUDA"}})
    assert report["gpu"] is None and report["kernels_per_decode_step"] is None
    assert report["kernel_variants"]["off"]["kernels_per_decode_step"] is None
    assert report["kernel_variants"]["off"]["env"] == {"SOME_SWITCH": "0"}
    assert set(report["step_ms"].values()) == {None}
    assert "kernels:off: failed: not recorded" in report["errors"]
    json.dumps(finite(report), allow_nan=False)


@pytest.mark.parametrize(
    ("count", "expected", "top"),
    [
        (
            {
                "cuda_graphs": True,
                "served": {"kernels": 2, "top": [["a", 2]]},
                "eager": {"kernels": 296, "top": [["e", 28]]},
            },
            296,
            [["e", 28]],
        ),
        (
            {
                "cuda_graphs": True,
                "served": {"kernels": 0, "top": []},
                "eager": {"kernels": 400, "top": [["b", 3]]},
            },
            400,
            [["b", 3]],
        ),
        ({"cuda_graphs": False, "served": {"kernels": 410, "top": [["c", 1]]}}, 410, [["c", 1]]),
        (
            {"cuda_graphs": False, "cpu_ops": 362, "counted": "CPU operators", "top": [["d", 9]]},
            None,
            [["d", 9]],
        ),
    ],
)
def test_the_kernel_count_reported(count: dict, expected: int | None, top: list) -> None:
    kernels, _, kernel_top = kernels_per_step(count)
    assert (kernels, kernel_top) == (expected, top)


def test_the_server_flags_are_the_engine_arguments_the_offline_engine_gets() -> None:
    engine_args = {**settings().engine_args, "max_model_len": 640, "enforce_eager": True}
    parsed = vars(build_parser().parse_args(["serve", "m", *cli_flags(engine_args)]))
    assert {name: parsed[name] for name in engine_args} == engine_args


def test_gpu_names_make_file_names() -> None:
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slug("cpu (dry run)") == "cpu-dry-run"


def test_the_dry_run_goes_through_every_stage_on_the_cpu(tmp_path: Path) -> None:
    """The whole pipeline as the GPU machine runs it: build, offline engine with its kernel count
    and decode table, the server under load, the count with the fused kernels off; the JSON."""
    cmd = [
        sys.executable, "bench/gpu/gpu_anchor.py", "--tiny", "--results-dir", str(tmp_path),
        "--num-prompts", "6", "--concurrency", "3", "--warmup", "1", "--decode-batches", "1,4",
        "--decode-steps", "2", "--kernel-batch", "2",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    written = list(tmp_path.glob("gpu-*-cpu-dry-run.json"))
    assert len(written) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(written[0].read_text())
    assert report["errors"] == [], report["errors"]
    assert done.returncode == 0
    assert report["dry_run"] is True and report["gpu"] == "cpu (dry run)"
    assert report["workload"]["prompts"] == 6
    for key in ("offline_out_tok_s_512_128", "server_out_tok_s_512_128", "server_over_offline"):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["server"]["completed"] == 6 and report["server"]["failed"] == 0
    assert list(report["step_ms"]) == ["1", "4"] and list(report["floor_ms"]) == ["1", "4"]
    assert all(isinstance(v, float) and v > 0 for v in report["step_ms"].values())
    assert all(isinstance(v, float) and v > 0 for v in report["floor_ms"].values())
    # No device kernels on a CPU: the count is of CPU operators, and says so.
    assert report["kernels_per_decode_step"] is None
    assert isinstance(report["cpu_ops_per_decode_step"], int)
    assert report["cpu_ops_per_decode_step"] > 0
    assert "CPU operators" in report["kernels_counted"]
    # By default the count runs again with the fused kernels off (the CPU has its own either way).
    assert report["engine_args"]["fused_kernels"] is True
    assert report["kernel_variants"]["unfused"]["engine_args"] == {"fused_kernels": False}
    assert "CPU operators" in report["kernel_variants"]["unfused"]["counted"]
    assert isinstance(report["attention_backend"], str)
    assert [stage["stage"] for stage in report["stages"]] == [
        "build",
        "offline",
        "serve",
        "kernels-unfused",
    ]
    assert not math.isnan(report["copy_bandwidth_gb_s"])


def test_a_run_out_of_time_still_writes_its_json(tmp_path: Path) -> None:
    """The time limit cuts the very first stage: nothing measured, the file still lands, exit 1."""
    cmd = [sys.executable, "bench/gpu/gpu_anchor.py", "--tiny", "--results-dir", str(tmp_path)]
    done = subprocess.run(
        [*cmd, "--time-limit-s", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    (written,) = tmp_path.glob("gpu-*-cpu-dry-run.json")
    report = json.loads(written.read_text())
    assert report["offline_out_tok_s_512_128"] is None and report["step_ms"]["1"] is None
    assert any(e.startswith("model: failed: timed out") for e in report["errors"])
    assert [s["status"] for s in report["stages"]] == ["failed: timed out after 1 s"]
