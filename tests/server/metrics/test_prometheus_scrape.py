"""A real Prometheus server (Debian's `prometheus`, installed by .ci/run), configured by
deploy/prometheus.yml with its target pointed at the test server on 127.0.0.1, scrapes it and
answers PromQL with exactly the counts the workload implies, and every query of every panel of
the Grafana dashboard returns data: the exposition is one Prometheus actually ingests. Started
with `--metrics-names vllm`, the server answers vLLM's names and labels instead, exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from config.sources import serve_config
from engine.async_engine import AsyncEngine
from server import cli
from server.app import attach_metrics
from tests.support.server_harness import (
    RunningServer,
    free_port,
    wait_until,
    wait_until_answering,
    wait_until_idle,
)

MODEL = "SmolLM2-135M-Instruct"
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def installed(tool: str) -> str:
    binary = shutil.which(tool)
    if binary is None:
        message = f"{tool} is not installed (apt-get install prometheus; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


def test_promtool_accepts_the_deploy_config() -> None:
    done = subprocess.run(
        [installed("promtool"), "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def alert(name: str) -> dict[str, Any]:
    (group,) = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return next(rule for rule in group["rules"] if rule["alert"] == name)


def expected(name: str) -> list[dict[str, Any]]:
    rule = alert(name)
    labels = {"model_name": "m", **rule["labels"]}
    return [{"exp_labels": labels, "exp_annotations": rule["annotations"]}]


def test_promtool_evaluates_the_kv_pressure_alerts(tmp_path: Path) -> None:
    """Prometheus's own rule engine (promtool test rules) on synthetic series: a pool above 90%
    for 10 minutes fires, one that dips below in that window does not; a mean KV wait of 2 s
    fires after its 10 minutes, 0.5 s never does."""
    usage = 'pagedserve:kv_cache_usage_perc{model_name="m"}'
    wait = 'pagedserve:request_kv_wait_time_seconds_{}{{model_name="m"}}'
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": usage, "values": "0.95x20"}],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "PagedserveKVCacheNearlyFull", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "PagedserveKVCacheNearlyFull",
                    "exp_alerts": expected("PagedserveKVCacheNearlyFull"),
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [{"series": usage, "values": "0.95x7 0.5 0.95x12"}],
            "alert_rule_test": [
                {"eval_time": "15m", "alertname": "PagedserveKVCacheNearlyFull", "exp_alerts": []}
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": wait.format("sum"), "values": "0+120x30"},  # 2 s per request
                {"series": wait.format("count"), "values": "0+60x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "PagedserveKVWaitHigh", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "PagedserveKVWaitHigh",
                    "exp_alerts": expected("PagedserveKVWaitHigh"),
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": wait.format("sum"), "values": "0+30x30"},  # 0.5 s per request
                {"series": wait.format("count"), "values": "0+60x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "25m", "alertname": "PagedserveKVWaitHigh", "exp_alerts": []}
            ],
        },
    ]
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(DEPLOY / "alerts.yml")],
                "evaluation_interval": "1m",
                "tests": tests,
            }
        )
    )
    for command in (["check", "rules", str(DEPLOY / "alerts.yml")], ["test", "rules", str(spec)]):
        done = subprocess.run(
            [installed("promtool"), *command], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr


@contextmanager
def scraping(target_port: int, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping 127.0.0.1:`target_port` as deploy/prometheus.yml says; its URL."""
    binary = installed("prometheus")
    settings = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # The shipped file, pointed at the test server and scraping faster so the test is short.
    settings["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    (job,) = settings["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(settings))
    shutil.copy(DEPLOY / "alerts.yml", tmp_path / "alerts.yml")  # rule_files: beside the config
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url + "/-/ready", process, tmp_path / "prometheus.log", timeout=30)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


@pytest.fixture
def prometheus(server: RunningServer, tmp_path: Path) -> Iterator[str]:
    with scraping(server.port, tmp_path) as url:
        yield url


def query(url: str, promql: str) -> float | None:
    response = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    assert response.status_code == 200, response.text
    result = response.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for_answer(url: str, promql: str, want: float, timeout: float = 20.0) -> None:
    """Prometheus sees a change only at its next scrape (every second here)."""
    wait_until(
        lambda: query(url, promql),
        timeout,
        until=lambda got: got == want,
        interval=0.25,
        what=f"Prometheus to answer {want} to {promql}",
    )


def test_prometheus_ingests_exact_counts(server: RunningServer, prometheus: str) -> None:
    selector = f'{{model_name="{MODEL}"}}'
    wait_until_idle(server.engine)
    wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)
    generated = query(prometheus, "pagedserve:generation_tokens_total" + selector)
    finished = query(
        prometheus,
        f'pagedserve:request_success_total{{model_name="{MODEL}",finished_reason="length"}}',
    )
    ttft = query(prometheus, "pagedserve:time_to_first_token_seconds_count" + selector)
    assert generated is not None and finished is not None and ttft is not None

    n, max_tokens = 3, 5
    for i in range(n):
        body = {
            "model": MODEL,
            "prompt": f"Item {i}:",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_until_idle(server.engine)

    wait_for_answer(
        prometheus, "pagedserve:generation_tokens_total" + selector, generated + n * max_tokens
    )
    wait_for_answer(
        prometheus,
        f'pagedserve:request_success_total{{model_name="{MODEL}",finished_reason="length"}}',
        finished + n,
    )
    wait_for_answer(prometheus, "pagedserve:time_to_first_token_seconds_count" + selector, ttft + n)
    wait_for_answer(prometheus, "pagedserve:num_requests_running" + selector, 0.0)
    wait_for_answer(prometheus, "pagedserve:kv_cache_usage_perc" + selector, 0.0)
    p99 = query(
        prometheus,
        f"histogram_quantile(0.99, pagedserve:time_to_first_token_seconds_bucket{selector})",
    )
    assert p99 is not None and p99 > 0


# The panels of what only some servers run: their metrics exist only there.
OPTIONAL_PANELS = {
    "speculative": ("spec_decode_",),
    "images": (":mm_",),
    "kv_offload": ("external_prefix_cache_", "kv_offload_"),
}


def dashboard_queries(
    speculative: bool = False, images: bool = False, kv_offload: bool = False
) -> list[str]:
    """The dashboard's PromQL: the panels of the one optional feature asked for
    (OPTIONAL_PANELS), or, none asked, all the others'."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    asked = [name for name, on in zip(OPTIONAL_PANELS, (speculative, images, kv_offload)) if on]
    if asked:
        (name,) = asked
        return [q for q in queries if any(m in q for m in OPTIONAL_PANELS[name])]
    markers = [m for group in OPTIONAL_PANELS.values() for m in group]
    return [q for q in queries if not any(m in q for m in markers)]


def answer(url: str, expr: str, model: str) -> list[dict[str, Any]]:
    """What Prometheus answers to a dashboard query, its variables filled in as Grafana does."""
    promql = expr.replace("$model_name", model).replace("$__rate_interval", "1m")
    response = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    assert response.status_code == 200, (promql, response.text)
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def test_every_dashboard_query_returns_data(server: RunningServer, prometheus: str) -> None:
    """The speculative-decoding, image and KV offload panels are checked on servers that run
    them (test_spec_decode_server.py, test_server_images.py, test_kv_offload_dashboard.py);
    here, on a text model without them, they show nothing at all rather than a misleading 0."""
    queries = dashboard_queries()
    assert len(queries) >= 12
    wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)
    # Traffic inside the queries' rate window: a shared prefix (cache hits), several steps.
    for i in range(3):
        body = {
            "model": MODEL,
            "prompt": "The same long opening line, again and again, for the cache. " * 4 + str(i),
            "max_tokens": 4,
            "temperature": 0,
        }
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(3)  # a few scrapes after the traffic
    for expr in queries:
        assert answer(prometheus, expr, MODEL), f"no data for {expr}"
    optional = [
        *dashboard_queries(speculative=True),
        *dashboard_queries(images=True),
        *dashboard_queries(kv_offload=True),
    ]
    assert len(optional) == 3 + 4 + 4
    for expr in optional:
        assert answer(prometheus, expr, MODEL) == [], expr


# --------------------------------------------------------------------------- vLLM's names

VLLM_SERVED_NAME = "served-for-vllm-dashboards"
SERIES_LABELS = {"model_name": VLLM_SERVED_NAME, "engine": "0"}
# Every family `--metrics-names vllm` publishes under vLLM's name, with vLLM's type.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}
# Queries shaped like the panels, alerts and autoscaler rules people write against vLLM.
VLLM_STYLE_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$m"}[1m])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$m"}[1m])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$m"}[1m])))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$m"}[1m]) / rate(vllm:request_queue_time_seconds_count{model_name="$m"}[1m])',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$m"}[1m]))',
    'rate(vllm:prompt_tokens_total{model_name="$m"}[1m])',
    'rate(vllm:generation_tokens_total{model_name="$m"}[1m])',
    "sum(rate(vllm:prefix_cache_hits_total[1m])) / sum(rate(vllm:prefix_cache_queries_total[1m]))",
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$m"}[1m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$m"}[1m]))',
    'max by(engine) (vllm:kv_cache_usage_perc{model_name="$m"})',
    "sum by(model_name) (vllm:num_requests_running) + sum by(model_name) (vllm:num_requests_waiting)",
    'sum(vllm:num_requests_waiting{model_name="$m"})',
]


@pytest.fixture
def vllm_named_server(llama_dir: Path) -> Iterator[RunningServer]:
    """What `pagedserve serve MODEL --metrics-names vllm ...` serves, built from those flags the
    way `server.cli` and `server.launch` build it, on an engine of its own: every count starts
    at 0, and the shared engine's metrics are left alone."""
    flags = [str(llama_dir), "--num-kv-blocks", "64", "--served-model-name", VLLM_SERVED_NAME]
    args = vars(cli.build_parser().parse_args(["serve", *flags, "--metrics-names", "vllm"]))
    settings = {k: v for k, v in args.items() if k not in ("command", "config")}
    config = serve_config(settings, os.environ)
    engine = AsyncEngine.from_config(config.engine)
    metrics = attach_metrics(engine, config.server)
    engine.start()
    try:
        running = RunningServer(engine, config.server, metrics)
        yield running
        running.stop()
    finally:
        engine.shutdown()


def test_vllm_names_and_labels_for_vllm_dashboards(
    vllm_named_server: RunningServer, tmp_path: Path
) -> None:
    """The switch, given on the command line: vLLM's names, types, buckets and labels, exact
    counts in a real Prometheus, no `pagedserve:` name where vLLM has one, and data for the
    queries vLLM dashboards run."""
    url = vllm_named_server.url
    with scraping(vllm_named_server.port, tmp_path) as prometheus:
        wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)  # a scrape from before the traffic
        n, max_tokens, prompt_tokens = 3, 5, 0
        with openai.OpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            for i in range(n):
                completion = client.completions.create(
                    model=VLLM_SERVED_NAME,
                    prompt=f"Item {i}:",
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                assert completion.choices[0].finish_reason == "length"
                assert completion.usage is not None
                assert completion.usage.completion_tokens == max_tokens
                prompt_tokens += completion.usage.prompt_tokens

        # The exposition itself: exactly vLLM's families, types, labels and buckets.
        text = httpx.get(url + "/metrics", timeout=10).text
        # Not the `_created` timestamps prometheus-client adds beside counters and histograms.
        families = [
            f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")
        ]
        ours = {f.name: f.type for f in families if f.name.startswith("pagedserve:")}
        assert {f.name: f.type for f in families if f.name.startswith("vllm:")} == VLLM_FAMILIES
        assert ours == {  # vLLM has no such metrics
            "pagedserve:request_rejected": "counter",
            "pagedserve:kv_preemptions": "counter",
            "pagedserve:request_kv_wait_time_seconds": "histogram",
            "pagedserve:kv_cache_free_blocks": "gauge",
            "pagedserve:kv_events_dropped": "counter",
        }
        reasons = set()
        for family in families:
            for sample in family.samples:
                labels = dict(sample.labels)
                labels.pop("le", None)
                if family.name == "vllm:request_success":
                    reasons.add(labels.pop("finished_reason"))
                if family.name in ("pagedserve:request_rejected", "pagedserve:kv_preemptions"):
                    labels.pop("reason")
                if family.name == "vllm:cache_config_info":
                    assert labels == {"block_size": "16", "num_gpu_blocks": "64", "engine": "0"}
                    assert sample.value == 1
                elif family.name.startswith(("vllm:", "pagedserve:")):
                    assert labels == SERIES_LABELS, (sample.name, sample.labels)
        assert reasons == {"stop", "length", "abort", "error"}
        bounds = {
            family.name: [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
            for family in families
            if family.type == "histogram"
        }
        # vLLM's boundaries: dashboards' quantiles and SLO thresholds (le="0.5") depend on them.
        assert len(bounds["vllm:time_to_first_token_seconds"]) == 22 + 1
        assert bounds["vllm:time_to_first_token_seconds"][::21] == ["0.001", "2560.0"]
        assert len(bounds["vllm:inter_token_latency_seconds"]) == 19 + 1
        assert bounds["vllm:inter_token_latency_seconds"][::18] == ["0.01", "80.0"]
        for name in ("e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert len(bounds["vllm:" + name]) == 21 + 1
            assert bounds["vllm:" + name][::20] == ["0.3", "7680.0"]
        assert bounds["vllm:iteration_tokens_total"][::12] == ["1.0", "16384.0"]

        # What Prometheus stored: exact counts under vLLM's names and labels.
        def at(name: str, **labels: str) -> str:
            matchers = ",".join(f'{k}="{v}"' for k, v in {**SERIES_LABELS, **labels}.items())
            return f"{name}{{{matchers}}}"

        wait_for_answer(prometheus, at("vllm:generation_tokens_total"), n * max_tokens)
        wait_for_answer(prometheus, at("vllm:request_success_total", finished_reason="length"), n)
        exact = {
            at("vllm:prompt_tokens_total"): prompt_tokens,
            at("vllm:request_success_total", finished_reason="stop"): 0,
            at("vllm:request_success_total", finished_reason="abort"): 0,
            at("vllm:time_to_first_token_seconds_count"): n,
            at("vllm:inter_token_latency_seconds_count"): n * (max_tokens - 1),
            at("vllm:e2e_request_latency_seconds_count"): n,
            at("vllm:request_queue_time_seconds_count"): n,
            at("vllm:request_prefill_time_seconds_count"): n,
            at("vllm:request_decode_time_seconds_count"): n,
            at("vllm:request_prompt_tokens_sum"): prompt_tokens,
            at("vllm:request_generation_tokens_sum"): n * max_tokens,
            at("vllm:prefix_cache_queries_total"): prompt_tokens,
            at("vllm:num_preemptions_total"): 0,
            at("vllm:num_requests_running"): 0,
            at("vllm:num_requests_waiting"): 0,
            at("vllm:kv_cache_usage_perc"): 0,
            'vllm:cache_config_info{engine="0",num_gpu_blocks="64"}': 1,
        }
        for promql, want in exact.items():
            wait_for_answer(prometheus, promql, want)
        hits = query(prometheus, at("vllm:prefix_cache_hits_total"))
        assert hits is not None
        computed = prompt_tokens - hits + n * (max_tokens - 1)
        wait_for_answer(prometheus, at("vllm:iteration_tokens_total_sum"), computed)
        names = httpx.get(prometheus + "/api/v1/label/__name__/values", timeout=5).json()
        stored = set(names["data"])  # every metric name Prometheus holds
        ours = {name for name in stored if name.startswith("pagedserve:")}
        assert ours == {  # the metrics vLLM has no name for
            f"pagedserve:{family}{suffix}"
            for family, suffixes in (
                ("request_rejected", ("_total", "_created")),
                ("kv_preemptions", ("_total", "_created")),
                ("kv_cache_free_blocks", ("",)),
                ("kv_events_dropped", ("_total", "_created")),
                ("request_kv_wait_time_seconds", ("_bucket", "_count", "_sum", "_created")),
            )
            for suffix in suffixes
        }
        assert "vllm:time_to_first_token_seconds_bucket" in stored

        time.sleep(2)  # two more scrapes inside the rate windows
        for expr in VLLM_STYLE_QUERIES:
            promql = expr.replace("$m", VLLM_SERVED_NAME)
            response = httpx.get(prometheus + "/api/v1/query", params={"query": promql}, timeout=5)
            assert response.status_code == 200, (promql, response.text)
            result = response.json()["data"]["result"]
            assert result, f"no data for {promql}"
            if "by(engine)" in promql:
                assert [r["metric"] for r in result] == [{"engine": "0"}]
