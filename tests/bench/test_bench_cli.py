"""`pagedserve bench serve` and `pagedserve bench throughput`: vLLM's flag names, refusals
that say what is wrong, a load against the real server over loopback whose counts must be exact
and whose latencies must agree with each other, multi-turn conversations that re-send their
history (seen from the engine's side), and the offline engine on a small random model."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest

from server.bench.datasets import DatasetError, custom_dataset, multi_turn_dataset
from server.cli import build_parser, main
from tests.support.server_harness import RunningServer


def _bench_serve(*flags: str) -> list[str]:
    return ["bench", "serve", "--disable-tqdm", *flags]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().out


def test_vllm_flag_names_are_taken() -> None:
    args = build_parser().parse_args(
        _bench_serve(
            "--model", "org/model", "--base-url", "http://10.0.0.5:8001", "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--dataset-name", "random",
            "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.5",
            "--num-prompts", "3", "--max-concurrency", "2", "--request-rate", "4", "--seed", "5",
            "--ignore-eos", "--save-result", "--result-filename", "r.json",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "90,99.9",
        )
    )  # fmt: skip
    assert (args.model, args.base_url, args.endpoint) == (
        "org/model",
        "http://10.0.0.5:8001",
        "/v1/chat/completions",
    )
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (32, 8, 0.5)
    assert (args.num_prompts, args.max_concurrency, args.request_rate, args.seed) == (3, 2, 4.0, 5)
    assert args.ignore_eos and args.save_result and args.result_filename == "r.json"
    assert args.disable_tqdm and args.backend == "openai-chat"
    assert (args.percentile_metrics, args.metric_percentiles) == (("ttft", "e2e"), (90.0, 99.9))

    defaults = build_parser().parse_args(["bench", "serve"])
    assert math.isinf(defaults.request_rate) and defaults.max_concurrency is None
    assert (defaults.host, defaults.port, defaults.endpoint) == (
        "127.0.0.1",
        8000,
        "/v1/completions",
    )
    assert (defaults.num_prompts, defaults.random_input_len, defaults.random_output_len) == (
        1000,
        1024,
        128,
    )

    offline = build_parser().parse_args(
        ["bench", "throughput", "--model", "m", "--num-prompts", "7", "--max-num-seqs", "4",
         "--output-json", "t.json"]
    )  # fmt: skip
    assert (offline.model, offline.num_prompts, offline.max_num_seqs) == ("m", 7, 4)
    assert offline.output_json == Path("t.json")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--random-range-ratio", "1"], "--random-range-ratio: must be in [0, 1), got 1"),
        (["--num-prompts", "0"], "--num-prompts: must be at least 1, got 0"),
        (["--max-concurrency", "two"], "--max-concurrency: expected a whole number, got 'two'"),
        (["--request-rate", "0"], "--request-rate: must be above 0 (inf: all at once)"),
        (["--request-rate", "fast"], "expected requests per second or inf, got 'fast'"),
        (["--burstiness", "0"], "--burstiness: must be a finite number above 0, got 0"),
        (["--burstiness", "0.5"], "--burstiness shapes the gaps between arrivals: it needs a"),
        (["--dataset-name", "sharegpt"], "invalid choice: 'sharegpt'"),
        (["--dataset-name", "custom"], "--dataset-name custom needs --dataset-path"),
        (["--dataset-path", "p.jsonl"], "--dataset-path is read only with --dataset-name custom"),
        (["--endpoint", "/v1/embeddings"], "--endpoint must be a path ending in completions"),
        (["--base-url", "https://example.com"], "--base-url must be an http:// URL"),
        (["--percentile-metrics", "ttft,latency"], "expected some of ttft, tpot, itl, e2el"),
        (["--metric-percentiles", "50,100"], "strictly between 0 and 100, got '50,100'"),
        (["--backend", "openai-chat"], "--backend openai-chat does not speak --endpoint /v1/comp"),
        (["--backend", "vllm", "--endpoint", "/v1/chat/completions"], "does not speak"),
    ],
)
def test_bad_values_are_refused_saying_why(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything is sent (no server listens on the default port here)."""
    with pytest.raises(SystemExit) as exit_:
        main(_bench_serve(*flags))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_server_that_cannot_be_reached_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(_bench_serve("--port", str(port), "--num-prompts", "1")) == 2
    assert f"cannot list http://127.0.0.1:{port}/v1/models" in capsys.readouterr().err


def test_a_custom_file_is_read_in_order_and_its_faults_are_located(tmp_path: Path) -> None:
    good = tmp_path / "prompts.jsonl"
    good.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n')
    turns = [c.turns[0] for c in custom_dataset(good, 3, 9)]
    assert [(t.prompt, t.output_len) for t in turns] == [("one", 9), ("two", 9), ("one", 9)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: expected \{\"prompt\""):
        custom_dataset(bad, 1, 9)


def test_conversations_open_with_their_own_document_or_a_shared_one(
    default_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)

    def firsts(same: bool) -> list[str]:
        conversations = multi_turn_dataset(tokenizer, 3, 2, 40, same, 8, 4, 0.0, 0)
        assert [len(c.turns) for c in conversations] == [2, 2, 2]
        return [str(c.turns[0].prompt).split("\n\n")[0] for c in conversations]

    own, shared = firsts(False), firsts(True)
    assert len(set(own)) == 3 and len(set(shared)) == 1
    assert 30 <= len(tokenizer(shared[0], add_special_tokens=False).input_ids) <= 50


def test_bench_serve_counts_exactly_and_its_latencies_agree(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Random prompts go as token ids, so the server's own prompt count must equal the asked
    length; ignore_eos makes every answer exactly --random-output-len tokens. The tokenizer is
    found from the `root` GET /v1/models gives."""
    result = tmp_path / "out" / "serve.json"
    code, out = _run(
        _bench_serve(
            "--base-url", server.url, "--num-prompts", "5", "--random-input-len", "12",
            "--random-output-len", "6", "--max-concurrency", "2", "--ignore-eos",
            "--metric-percentiles", "90,99", "--result-dir", str(tmp_path / "out"), "--result-filename", "serve.json",
        ),
        capsys,
    )  # fmt: skip
    assert code == 0
    for line in ("Successful requests:", "Median TTFT (ms):", "P90 ITL (ms):", "P99 E2E (ms):"):
        assert line in out
    report = json.loads(result.read_text())
    assert (report["completed"], report["failed"], report["errors"]) == (5, 0, {})
    assert report["config"]["model"] == "SmolLM2-135M-Instruct"
    assert (report["input_tokens"], report["output_tokens"]) == (5 * 12, 5 * 6)
    assert report["length_mismatches"] == 0
    duration = report["duration_s"]
    assert report["request_throughput"] == pytest.approx(5 / duration)
    assert report["output_throughput"] == pytest.approx(30 / duration)
    for row in report["requests"]:
        assert row["ok"] and (row["input_len"], row["output_tokens"]) == (12, 6)
        assert 0 < row["ttft"] <= row["e2e"] <= duration
        assert row["tpot"] == pytest.approx((row["e2e"] - row["ttft"]) / 5)
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[name]
        assert 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"], name
    assert report["ttft"]["mean_ms"] <= report["e2e"]["mean_ms"]
    assert report["itl"]["p99_ms"] <= report["e2e"]["p99_ms"]


def test_multi_turn_resends_the_history_each_turn(
    server: RunningServer,
    default_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What the engine is handed: each turn's prompt holds the whole previous turn's prompt
    (template included) and grows by at least the answer; one request at a time, turns go
    round the conversations."""
    from transformers import AutoTokenizer

    seen: list[list[int]] = []
    submit = server.engine.submit

    async def recording(request: Any) -> Any:
        seen.append(list(request.prompt_token_ids))
        return await submit(request)

    monkeypatch.setattr(server.engine, "submit", recording)
    result = tmp_path / "turns.json"
    code, _ = _run(
        _bench_serve(
            "--base-url", server.url, "--endpoint", "/v1/chat/completions",
            "--dataset-name", "multi-turn", "--multi-turn-num-conversations", "2",
            "--multi-turn-num-turns", "3", "--multi-turn-document-len", "24",
            "--random-input-len", "6", "--random-output-len", "4", "--ignore-eos",
            "--max-concurrency", "1", "--num-warmups", "0", "--tokenizer", str(default_model_dir),
            "--result-filename", str(result),
        ),
        capsys,
    )  # fmt: skip
    assert code == 0
    report = json.loads(result.read_text())
    assert (report["completed"], report["output_tokens"]) == (6, 6 * 4)
    assert len(seen) == 6
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = [tokenizer.decode(ids) for ids in seen]
    # Submitted in the order c0t0, c1t0, c0t1, c1t1, c0t2, c1t2.
    for earlier, later in ((0, 2), (2, 4), (1, 3), (3, 5)):
        assert texts[later].startswith(texts[earlier])
        assert len(seen[later]) >= len(seen[earlier]) + 4
    assert not texts[1].startswith(texts[0]) and not texts[0].startswith(texts[1])
    rows = {(r["conversation"], r["turn"]): r for r in report["requests"]}
    assert [rows[c, t]["input_len"] for t in range(3) for c in range(2)] == [len(s) for s in seen]


def test_bench_throughput_runs_the_offline_engine(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "throughput.json"
    code, out = _run(
        ["bench", "throughput", "--model", str(llama_dir), "--num-prompts", "5",
         "--random-input-len", "12", "--random-output-len", "6", "--ignore-eos",
         "--max-num-seqs", "4", "--output-json", str(result)],
        capsys,
    )  # fmt: skip
    assert code == 0 and out.startswith("Throughput: ")
    report = json.loads(result.read_text())
    assert (report["num_requests"], report["total_input_tokens"]) == (5, 60)
    assert report["total_output_tokens"] == 30
    elapsed = report["elapsed_time"]
    assert report["requests_per_second"] == pytest.approx(5 / elapsed)
    assert report["output_tokens_per_second"] == pytest.approx(30 / elapsed)
    assert report["config"]["engine"] == {"max_num_seqs": 4}

    turns = tmp_path / "turns.json"
    code, _ = _run(
        ["bench", "throughput", "--model", str(llama_dir), "--dataset-name", "multi-turn",
         "--multi-turn-num-conversations", "2", "--multi-turn-num-turns", "2",
         "--multi-turn-document-len", "16", "--random-input-len", "4",
         "--random-output-len", "3", "--ignore-eos", "--output-json", str(turns)],
        capsys,
    )  # fmt: skip
    assert code == 0
    report = json.loads(turns.read_text())
    assert (report["num_requests"], report["total_output_tokens"]) == (4, 4 * 3)
    # Second turns re-send the first turns' prompts and answers.
    assert report["total_input_tokens"] > 2 * 2 * 16
