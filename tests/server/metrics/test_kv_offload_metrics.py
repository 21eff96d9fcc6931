"""The KV offload tier metrics from engine stats, read back from the exposition as Prometheus
parses it: exact totals over two snapshots, vLLM's names for the external prefix-cache
counters under `--metrics-names vllm` (ours for the rest), gauges that follow the latest
snapshot, and no tier series for an engine without tiers."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats, KVOffloadStats
from server.metrics.collector import EngineMetrics
from server.metrics.names import MetricNames


def metrics(scheme: str, tiers: tuple[str, ...]) -> EngineMetrics:
    return EngineMetrics(
        CollectorRegistry(),
        "m",
        16,
        64,
        128,
        MetricNames(scheme),  # type: ignore[arg-type]
        kv_offload_tiers=tiers,
    )


def samples(m: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k in ("direction", "tier"))),
        ): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if ("external_" in s.name or "kv_offload" in s.name) and not s.name.endswith("_created")
    }


def tiers(**kwargs: dict[str, int]) -> KVOffloadStats:
    return KVOffloadStats(**kwargs)


@pytest.mark.parametrize(("scheme", "prefix"), [("pagedserve", "pagedserve:"), ("vllm", "vllm:")])
def test_exact_totals_after_two_snapshots(scheme: str, prefix: str) -> None:
    m = metrics(scheme, ("host", "disk"))
    # At 0 from start-up, so that a rate() over the first traffic sees all of it.
    moved = "pagedserve:kv_offload_bytes_total"  # no vLLM equivalent: ours
    assert samples(m) == {
        (f"{prefix}external_prefix_cache_queries_total", ()): 0,
        (f"{prefix}external_prefix_cache_hits_total", ()): 0,
        **{
            (moved, (("direction", d), ("tier", t))): 0
            for d in ("store", "load")
            for t in ("host", "disk")
        },
        ("pagedserve:kv_offload_dropped_blocks_total", (("tier", "disk"),)): 0,
        **{
            (f"pagedserve:kv_offload_{g}_bytes", (("tier", t),)): 0
            for g in ("used", "capacity")
            for t in ("host", "disk")
        },
    }
    m.record(
        EngineStats(
            external_prefix_cache_queries=300,
            external_prefix_cache_hits=128,
            kv_offload=tiers(
                bytes_stored={"host": 4096, "disk": 4096},
                bytes_loaded={"host": 8192},
                blocks_dropped={"disk": 3},
                used_bytes={"host": 4096, "disk": 4400},
                capacity_bytes={"host": 2**20, "disk": 2**21},
            ),
        )
    )
    m.record(
        EngineStats(
            external_prefix_cache_queries=100,
            external_prefix_cache_hits=64,
            kv_offload=tiers(
                bytes_loaded={"disk": 4096},
                blocks_dropped={"disk": 2},
                used_bytes={"host": 8192, "disk": 4400},
                capacity_bytes={"host": 2**20, "disk": 2**21},
            ),
        )
    )
    got = samples(m)
    assert got[(f"{prefix}external_prefix_cache_queries_total", ())] == 400
    assert got[(f"{prefix}external_prefix_cache_hits_total", ())] == 192
    assert got[(moved, (("direction", "store"), ("tier", "host")))] == 4096
    assert got[(moved, (("direction", "store"), ("tier", "disk")))] == 4096
    assert got[(moved, (("direction", "load"), ("tier", "host")))] == 8192
    assert got[(moved, (("direction", "load"), ("tier", "disk")))] == 4096
    assert got[("pagedserve:kv_offload_dropped_blocks_total", (("tier", "disk"),))] == 5
    assert got[("pagedserve:kv_offload_used_bytes", (("tier", "host"),))] == 8192
    assert got[("pagedserve:kv_offload_capacity_bytes", (("tier", "disk"),))] == 2**21


def test_an_engine_without_tiers_publishes_no_tier_series() -> None:
    m = metrics("pagedserve", ())
    m.record(EngineStats(prefix_cache_queries=10, prefix_cache_hits=5))
    assert samples(m) == {}
