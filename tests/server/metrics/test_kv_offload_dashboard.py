"""The dashboard's KV offload panels, answered by a real Prometheus scraping a server whose pool
is too small for its documents and whose host tier holds them (a disk tier beside it):
documents read once, then again after the pool has evicted them. The engine is the server's
own, so its counters start at 0 in the rate window and each panel's ratio is the ratio of the
server's own totals."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from config import ServerConfig
from server.app import attach_metrics
from tests.server.metrics.test_prometheus_scrape import (
    answer,
    dashboard_queries,
    scraping,
    wait_for_answer,
)
from tests.support.server_harness import RunningServer, start_engine

MODEL = "kv-offload-dashboard"
BLOCK = 16
_rng = random.Random(3)
DOCS = [[_rng.randrange(1000, 20000) for _ in range(4 * BLOCK)] for _ in range(5)]


def totals(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's /metrics, by name and its labels other than the model's."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_dashboards_kv_offload_panels_answer_from_a_real_prometheus(
    llama_dir: Path, tmp_path: Path
) -> None:
    engine = start_engine(
        model=str(llama_dir),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=128,
        max_num_seqs=2,
        num_kv_blocks=12,  # two documents at most: revisits find theirs evicted
        kv_offloading_size=0.002,
        kv_offloading_disk_dir=str(tmp_path / "tier"),
        kv_offloading_disk_size=0.004,
    )
    config = ServerConfig(served_model_name=[MODEL])
    server = RunningServer(engine, config, attach_metrics(engine, config))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        with scraping(server.port, tmp_path) as prometheus, client:
            wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)  # a scrape from before
            for question in (7, 8):
                for doc in DOCS:
                    client.completions.create(
                        model=MODEL, prompt=[*doc, question], max_tokens=2, temperature=0
                    )
            seen = totals(server.url)
            hits = seen[("pagedserve:external_prefix_cache_hits_total", ())]
            queries = seen[("pagedserve:external_prefix_cache_queries_total", ())]
            assert hits >= 3 * 4 * BLOCK  # the first three documents at least came back
            selector = f'{{model_name="{MODEL}"}}'
            wait_for_answer(
                prometheus, "pagedserve:external_prefix_cache_hits_total" + selector, hits
            )
            hit_rate, moved, usage, dropped = dashboard_queries(kv_offload=True)
            [[_, got]] = [r["value"] for r in answer(prometheus, hit_rate, MODEL)]
            assert float(got) == pytest.approx(hits / queries)
            by_series = {
                (r["metric"]["direction"], r["metric"]["tier"]): float(r["value"][1])
                for r in answer(prometheus, moved, MODEL)
            }
            # Every series from start-up; revisits find the host tier first, never the disk.
            assert set(by_series) == {(d, t) for d in ("store", "load") for t in ("host", "disk")}
            assert by_series.pop(("load", "disk")) == 0
            assert all(rate > 0 for rate in by_series.values())
            rows = {
                r["metric"]["tier"]: float(r["value"][1]) for r in answer(prometheus, usage, MODEL)
            }
            assert set(rows) == {"host", "disk"}
            used = seen[("pagedserve:kv_offload_used_bytes", (("tier", "host"),))]
            capacity = seen[("pagedserve:kv_offload_capacity_bytes", (("tier", "host"),))]
            assert rows["host"] == pytest.approx(used / capacity)
            assert 0 < used <= capacity
            # The disk kept up with these few blocks: none dropped.
            [row] = answer(prometheus, dropped, MODEL)
            assert float(row["value"][1]) == 0
    finally:
        server.stop()
        engine.shutdown()
