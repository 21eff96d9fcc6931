"""Image-input metrics, from the engine's stats: encoder-cache lookups and hits (in images, as
vLLM's `mm_cache_queries` / `mm_cache_hits` count them), images encoded, and the time a
prompt's images took to preprocess. They exist only for a vision-language model, so that a
text model publishes no series that would only ever read 0."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.stats import EngineStats
from server.metrics.names import MetricNames

PREPROCESSING_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class MultiModalMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        names: MetricNames,
        labels: list[str],
        values: tuple[str, ...],
    ) -> None:
        """`labels` / `values`: the label names and values every series of the server carries."""

        def counter(name: str, doc: str) -> Counter:
            return Counter(names.name(name), doc, labels, registry=registry)

        self.queries = counter(
            "mm_cache_queries", "Images a prompt chunk reached, looked up in the encoder cache."
        ).labels(*values)
        self.hits = counter(
            "mm_cache_hits", "Images whose encoder output was found in the encoder cache."
        ).labels(*values)
        self.encoded = counter("mm_images_encoded", "Images run through the encoder.").labels(
            *values
        )
        self.preprocessing = Histogram(
            names.name("mm_preprocessing_seconds"),
            "Time a prompt's images took to preprocess (decoded images to encoder inputs).",
            labels,
            buckets=PREPROCESSING_BUCKETS,
            registry=registry,
        ).labels(*values)

    def record(self, stats: EngineStats) -> None:
        self.queries.inc(stats.mm_cache_queries)
        self.hits.inc(stats.mm_cache_hits)
        self.encoded.inc(stats.mm_images_encoded)
        for seconds in stats.mm_preprocessing_seconds:
            self.preprocessing.observe(seconds)
