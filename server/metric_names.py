"""What the metrics are called at /metrics. By default our own names (`pagedserve:*`, label
`model_name`); with `--metrics-names vllm`, the names and labels a vLLM (v1 engine) server
publishes for the same measurements, so that Grafana dashboards, alert rules and autoscaler
queries written for vLLM select our series without a change. Only the names change: what is
measured, and how, is the same under both."""

from __future__ import annotations

from dataclasses import dataclass

from config.server_config import MetricsNames

PREFIX = "pagedserve:"

# Each metric we measure, keyed by its family name as `server.metrics` declares it (counters
# without `_total`, which the client library appends, as it does for vLLM's), and vLLM's name
# for the same measurement. A metric missing here has no vLLM equivalent and keeps its
# `pagedserve:` name: a dashboard written for vLLM never asks for it, and ours still can.
VLLM_NAMES: dict[str, str] = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "num_preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "request_success": "vllm:request_success",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "request_prompt_tokens": "vllm:request_prompt_tokens",
    "request_generation_tokens": "vllm:request_generation_tokens",
    "iteration_tokens_total": "vllm:iteration_tokens_total",
    "cache_config_info": "vllm:cache_config_info",
}

# vLLM labels every series with the index of the engine core that produced it (several under
# data parallelism); dashboards filter and aggregate on it. This server runs one engine.
VLLM_LABELS: dict[str, str] = {"engine": "0"}


@dataclass(frozen=True)
class MetricNames:
    scheme: MetricsNames = "pagedserve"

    def name(self, metric: str) -> str:
        """The published family name of `metric` (a key of `VLLM_NAMES` or one of ours)."""
        if self.scheme == "vllm" and metric in VLLM_NAMES:
            return VLLM_NAMES[metric]
        return PREFIX + metric

    @property
    def labels(self) -> dict[str, str]:
        """Labels with fixed values that every series of this scheme carries."""
        return dict(VLLM_LABELS) if self.scheme == "vllm" else {}
