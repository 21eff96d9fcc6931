"""The image-input metrics from engine stats, read back from the exposition as Prometheus
parses it: exact totals over two snapshots, vLLM's names for the encoder-cache counters under
`--metrics-names vllm` (ours for the rest), and no image series for a text model."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats
from server.metrics.collector import EngineMetrics
from server.metrics.names import MetricNames

MODEL = "vlm"


def metrics(scheme: str, images: bool) -> EngineMetrics:
    names = MetricNames(scheme)  # type: ignore[arg-type]
    return EngineMetrics(CollectorRegistry(), MODEL, 16, 64, 128, names, None, None, images)


def samples(m: EngineMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "mm_" in s.name and not s.name.endswith("_created") and "_bucket" not in s.name
    }


@pytest.mark.parametrize(
    ("scheme", "cache_prefix"), [("pagedserve", "pagedserve:"), ("vllm", "vllm:")]
)
def test_exact_totals_after_two_snapshots(scheme: str, cache_prefix: str) -> None:
    m = metrics(scheme, images=True)
    m.record(
        EngineStats(
            mm_cache_queries=3,
            mm_cache_hits=1,
            mm_images_encoded=2,
            mm_preprocessing_seconds=[0.02, 0.3],
        )
    )
    m.record(EngineStats(mm_cache_queries=2, mm_cache_hits=2, mm_preprocessing_seconds=[0.004]))
    got = samples(m)
    assert got[f"{cache_prefix}mm_cache_queries_total"] == 5
    assert got[f"{cache_prefix}mm_cache_hits_total"] == 3
    assert got["pagedserve:mm_images_encoded_total"] == 2  # no vLLM equivalent: ours
    assert got["pagedserve:mm_preprocessing_seconds_count"] == 3
    assert got["pagedserve:mm_preprocessing_seconds_sum"] == pytest.approx(0.324)


def test_a_text_model_publishes_no_image_series() -> None:
    m = metrics("pagedserve", images=False)
    m.record(EngineStats())
    assert samples(m) == {}
