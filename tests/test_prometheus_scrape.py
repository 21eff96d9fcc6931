"""A real Prometheus server (Debian's `prometheus`, installed by .ci/run), configured by
deploy/prometheus.yml with its target pointed at the test server on 127.0.0.1, scrapes it and
answers PromQL with exactly the counts the workload implies, and every query of every panel of
the Grafana dashboard returns data: the exposition is one Prometheus actually ingests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server_harness import (
    RunningServer,
    free_port,
    wait_until_answering,
    wait_until_idle,
)

MODEL = "SmolLM2-135M-Instruct"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


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


@pytest.fixture
def prometheus(server: RunningServer, tmp_path: Path) -> Iterator[str]:
    binary = installed("prometheus")
    settings = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # The shipped file, pointed at the test server and scraping faster so the test is short.
    settings["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    (job,) = settings["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(settings))
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


def query(url: str, promql: str) -> float | None:
    response = httpx.get(url + "/api/v1/query", params={"query": promql}, timeout=5)
    assert response.status_code == 200, response.text
    result = response.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(url: str, promql: str, want: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = query(url, promql)
        if got == want:
            return
        time.sleep(0.25)
    raise AssertionError(f"{promql}: Prometheus has {got}, expected {want}")


def test_prometheus_ingests_exact_counts(server: RunningServer, prometheus: str) -> None:
    selector = f'{{model_name="{MODEL}"}}'
    wait_until_idle(server.engine)
    wait_for(prometheus, 'up{job="pagedserve"}', 1.0)
    generated = query(prometheus, "pagedserve:generation_tokens_total" + selector)
    finished = query(
        prometheus,
        'pagedserve:request_success_total{model_name="%s",finished_reason="length"}' % MODEL,
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

    wait_for(
        prometheus, "pagedserve:generation_tokens_total" + selector, generated + n * max_tokens
    )
    wait_for(
        prometheus,
        'pagedserve:request_success_total{model_name="%s",finished_reason="length"}' % MODEL,
        finished + n,
    )
    wait_for(prometheus, "pagedserve:time_to_first_token_seconds_count" + selector, ttft + n)
    wait_for(prometheus, "pagedserve:num_requests_running" + selector, 0.0)
    wait_for(prometheus, "pagedserve:kv_cache_usage_perc" + selector, 0.0)
    p99 = query(
        prometheus,
        "histogram_quantile(0.99, pagedserve:time_to_first_token_seconds_bucket%s)" % selector,
    )
    assert p99 is not None and p99 > 0


def test_every_dashboard_query_returns_data(server: RunningServer, prometheus: str) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    assert len(queries) >= 12
    wait_for(prometheus, 'up{job="pagedserve"}', 1.0)
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
        promql = expr.replace("$model_name", MODEL).replace("$__rate_interval", "1m")
        response = httpx.get(prometheus + "/api/v1/query", params={"query": promql}, timeout=5)
        assert response.status_code == 200, (promql, response.text)
        assert response.json()["data"]["result"], f"no data for {promql}"
