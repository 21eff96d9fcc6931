"""Prometheus metrics that measure what vLLM's do, with vLLM's types, units and buckets, named
by `server.metrics.names`: ours (`pagedserve:*`, label `model_name`) or, on request, vLLM's exact
names and labels. They are fed from the engine thread with `EngineStats` after every iteration,
including idle ones, so gauges never go stale: once the last request ends or is aborted,
running, waiting and KV usage read 0."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.stats import EngineStats
from server.metrics.kv_offload import KVOffloadMetrics
from server.metrics.multimodal import MultiModalMetrics
from server.metrics.names import MetricNames
from server.metrics.spec_decode import SpecDecodeMetrics

# Bucket boundaries as vLLM publishes them.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: the engine failed the request
REJECT_REASONS = ("queue_full", "queue_timeout", "shutting_down")
# Why a running sequence was preempted: the pool had no block for it, or a more urgent waiting
# request needed its place (--scheduling-policy priority).
PREEMPTION_REASONS = ("kv_cache", "priority")
# Waiting for KV room: from a blink to the minutes a saturated pool can impose.
KV_WAIT_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: token-count buckets that fit the context."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return buckets
            buckets.append(value)
        scale *= 10


class EngineMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        names: MetricNames | None = None,
        max_loras: int | None = None,
        num_speculative_tokens: int | None = None,
        images: bool = False,
        kv_offload_tiers: tuple[str, ...] = (),
    ) -> None:
        """`max_loras`: the LoRA slots, when LoRA is on (its metrics exist only then);
        `num_speculative_tokens`: the tokens guessed per step, when speculation is on (ditto);
        `images`: the model reads images (ditto for the image metrics); `kv_offload_tiers`: the KV
        offload tiers on, 'host' and/or 'disk' (ditto for theirs)."""
        self.registry = registry
        names = names or MetricNames()
        fixed = names.labels
        labels = ["model_name", *fixed]
        m = (model_name, *fixed.values())  # the values of `labels`, for every series

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(names.name(name), doc, labels, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(names.name(name), doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
            return Histogram(names.name(name), doc, labels, buckets=buckets, registry=registry)

        self.running = gauge("num_requests_running", "Sequences in the running batch.").labels(*m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(*m)
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV cache usage: 1 means every block is in use."
        ).labels(*m)
        self.preemptions = counter("num_preemptions", "Preemptions (recompute).").labels(*m)
        by_reason = counter("kv_preemptions", "Preemptions (recompute), by reason.", ("reason",))
        self.preemptions_by_reason = {r: by_reason.labels(*m, r) for r in PREEMPTION_REASONS}
        self.free_blocks = gauge(
            "kv_cache_free_blocks", "KV blocks free (cached ones included)."
        ).labels(*m)
        self.kv_wait = histogram(
            "request_kv_wait_time_seconds",
            "Time a request waited because the KV pool had no room (part of its queue time).",
            KV_WAIT_BUCKETS,
        ).labels(*m)
        self.kv_events_dropped = counter(
            "kv_events_dropped",
            "KV event batches dropped because the publisher's queue was full (the next batch "
            "then clears the subscribers' view).",
        ).labels(*m)
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(*m)
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(*m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(*m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(*m)
        success = counter("request_success", "Requests finished, by reason.", ("finished_reason",))
        self.success = {reason: success.labels(*m, reason) for reason in FINISH_REASONS}
        rejected = counter("request_rejected", "Requests refused with 503, by reason.", ("reason",))
        self.rejected = {reason: rejected.labels(*m, reason) for reason in REJECT_REASONS}
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        ).labels(*m)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between successive tokens of a sample.",
            ITL_BUCKETS,
        ).labels(*m)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        ).labels(*m)
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS
        ).labels(*m)
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "First scheduled to first token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*m)
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        ).labels(*m)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        ).labels(*m)
        self.request_generation = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        ).labels(*m)
        self.iteration = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS
        ).labels(*m)
        info = Gauge(
            names.name("cache_config_info"),
            "KV cache configuration.",
            ["block_size", "num_gpu_blocks", *fixed],
            registry=registry,
        )
        info.labels(str(block_size), str(num_blocks), *fixed.values()).set(1)
        self.lora: LoRAMetrics | None = None
        if max_loras is not None:
            per_adapter = counter(
                "lora_requests", "Requests finished under each LoRA adapter.", ("lora_name",)
            )
            self.lora = LoRAMetrics(registry, names, max_loras, per_adapter, m)
        self.spec_decode: SpecDecodeMetrics | None = None
        if num_speculative_tokens is not None:
            self.spec_decode = SpecDecodeMetrics(registry, names, num_speculative_tokens, labels, m)
        self.multimodal = MultiModalMetrics(registry, names, labels, m) if images else None
        # From start-up, at 0: a rate() over the first traffic then sees all of it.
        self.kv_offload = (
            KVOffloadMetrics(registry, names, labels, m, kv_offload_tiers)
            if kv_offload_tiers
            else None
        )

    def reject(self, reason: str) -> None:
        """Called on the event loop when the admission gate refuses or drops a request."""
        self.rejected[reason].inc()

    def record(self, stats: EngineStats) -> None:
        """Called on the engine thread; prometheus-client's metrics are thread-safe."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        for reason, count in stats.preemptions_by_reason.items():
            self.preemptions_by_reason[reason].inc(count)
        self.free_blocks.set(stats.num_free_blocks)
        self.kv_events_dropped.inc(stats.kv_events_dropped)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generation_tokens)
        for value in stats.time_to_first_token:
            self.ttft.observe(value)
        for value in stats.inter_token_latency:
            self.itl.observe(value)
        for tokens in stats.iteration_tokens:
            self.iteration.observe(tokens)
        if self.lora is not None:
            self.lora.record(stats)
        if self.spec_decode is not None:
            self.spec_decode.record(stats.spec_decode)
        if self.multimodal is not None:
            self.multimodal.record(stats)
        if self.kv_offload is not None:
            self.kv_offload.record(stats)
        for done in stats.finished:
            self.success[done.finish_reason].inc()
            self.e2e.observe(done.e2e_latency)
            self.request_prompt.observe(done.num_prompt_tokens)
            self.request_generation.observe(done.num_generation_tokens)
            self.kv_wait.observe(done.kv_wait_time)
            for histogram, seconds in (
                (self.queue, done.queue_time),
                (self.prefill, done.prefill_time),
                (self.decode, done.decode_time),
            ):
                if seconds is not None:
                    histogram.observe(seconds)


class LoRAMetrics:
    """vLLM's `lora_requests_info`: one series whose labels name the adapters of the running
    and the waiting requests now (the gateways that route by adapter read them), its value the
    time it was last set; the series of the previous state is removed when the state changes.
    And finished requests counted per adapter."""

    def __init__(
        self,
        registry: CollectorRegistry,
        names: MetricNames,
        max_loras: int,
        requests: Counter,
        labels: tuple[str, ...],
    ) -> None:
        """`requests`: the per-adapter counter, labelled `labels` then the adapter's name."""
        fixed = names.labels
        self.fixed = tuple(fixed.values())
        self.max_lora = str(max_loras)
        self.info = Gauge(
            names.name("lora_requests_info"),
            "Running stats on LoRA requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters", *fixed],
            registry=registry,
        )
        self.requests = requests
        self.per_adapter_labels = labels
        self.shown: tuple[str, str] | None = None

    def record(self, stats: EngineStats) -> None:
        now = (",".join(stats.running_loras), ",".join(stats.waiting_loras))
        if self.shown is not None and self.shown != now:
            self.info.remove(self.max_lora, *self.shown, *self.fixed)
        self.shown = now
        self.info.labels(self.max_lora, *now, *self.fixed).set_to_current_time()
        for done in stats.finished:
            if done.lora_name is not None:
                self.requests.labels(*self.per_adapter_labels, done.lora_name).inc()
        # After its last request was counted: run-time loads would otherwise grow the series
        # without bound. (A series only exists once a request under the adapter finished.)
        for name in stats.unloaded_loras:
            with contextlib.suppress(KeyError):
                self.requests.remove(*self.per_adapter_labels, name)
