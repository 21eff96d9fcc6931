"""KV offload tier metrics, from the engine's stats: the tiers' prefix lookups in tokens (vLLM's
`external_prefix_cache_queries` / `external_prefix_cache_hits`, its KV connector's counters),
bytes copied into and out of each tier, blocks the disk tier dropped (its write queue full), and
each tier's use and capacity. They exist from start-up, at 0, on a server with tiers, and not
at all on one without."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.stats import EngineStats
from server.metrics.names import MetricNames

DIRECTIONS = ("store", "load")  # into a tier (from the pool), out of one (into the pool)


class KVOffloadMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        names: MetricNames,
        labels: list[str],
        values: tuple[str, ...],
        tiers: tuple[str, ...],
    ) -> None:
        """`labels` / `values`: the label names and values every series of the server carries;
        `tiers`: the tiers on, whose series start at 0."""

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(names.name(name), doc, [*labels, *extra], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(names.name(name), doc, [*labels, "tier"], registry=registry)

        self.values = values
        self.queries = counter(
            "external_prefix_cache_queries",
            "Prompt tokens of the requests that looked up the KV offload tiers.",
        ).labels(*values)
        self.hits = counter(
            "external_prefix_cache_hits", "Prompt tokens loaded from the KV offload tiers."
        ).labels(*values)
        self.bytes = counter(
            "kv_offload_bytes",
            "Bytes copied into a KV offload tier (store) or out of it into the pool (load).",
            ("direction", "tier"),
        )
        for direction in DIRECTIONS:
            for tier in tiers:
                self.bytes.labels(*values, direction, tier)
        self.dropped = counter(
            "kv_offload_dropped_blocks",
            "Blocks a KV offload tier did not store because its write queue was full.",
            ("tier",),
        )
        if "disk" in tiers:  # the one tier with a write queue
            self.dropped.labels(*values, "disk")
        self.used = gauge("kv_offload_used_bytes", "Bytes a KV offload tier holds.")
        self.capacity = gauge("kv_offload_capacity_bytes", "A KV offload tier's budget in bytes.")
        for tier in tiers:  # set from the engine's first stats
            self.used.labels(*values, tier)
            self.capacity.labels(*values, tier)

    def record(self, stats: EngineStats) -> None:
        self.queries.inc(stats.external_prefix_cache_queries)
        self.hits.inc(stats.external_prefix_cache_hits)
        tiers = stats.kv_offload
        if tiers is None:
            return
        for direction, moved in (("store", tiers.bytes_stored), ("load", tiers.bytes_loaded)):
            for tier, count in moved.items():
                self.bytes.labels(*self.values, direction, tier).inc(count)
        for tier, count in tiers.blocks_dropped.items():
            self.dropped.labels(*self.values, tier).inc(count)
        for tier, used in tiers.used_bytes.items():
            self.used.labels(*self.values, tier).set(used)
        for tier, capacity in tiers.capacity_bytes.items():
            self.capacity.labels(*self.values, tier).set(capacity)
