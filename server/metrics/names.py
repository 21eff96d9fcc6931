"""What the metrics are called at /metrics. By default our own names (`pagedserve:*`, label
`model_name`); with `--metrics-names vllm`, the names and labels a vLLM (v1 engine) server
publishes for the same measurements, so that Grafana dashboards, alert rules and autoscaler
queries written for vLLM select our series without a change. Only the names change: what is
measured, and how, is the same under both."""

from __future__ import annotations

from dataclasses import dataclass

from config.server_config import MetricsNames

PREFIX = "pagedserve:"

# The metrics vLLM also publishes, by their family name as `collector.py` declares it (counters
# without `_total`, which the client library appends, as it does for vLLM's): vLLM names each
# one `vllm:` + the same name. A metric missing here has no vLLM equivalent and keeps its
# `pagedserve:` name: a dashboard written for vLLM never asks for it, and ours still can.
VLLM_PREFIX = "vllm:"
IN_VLLM = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "iteration_tokens_total",
        "cache_config_info",
        "lora_requests_info",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
        "mm_cache_queries",
        "mm_cache_hits",
    }
)

# vLLM labels every series with the index of the engine core that produced it (several under
# data parallelism); dashboards filter and aggregate on it. This server runs one engine.
VLLM_LABELS: dict[str, str] = {"engine": "0"}


@dataclass(frozen=True)
class MetricNames:
    scheme: MetricsNames = "pagedserve"

    def name(self, metric: str) -> str:
        """The published family name of `metric` (vLLM's when it has one and is asked for)."""
        if self.scheme == "vllm" and metric in IN_VLLM:
            return VLLM_PREFIX + metric
        return PREFIX + metric

    @property
    def labels(self) -> dict[str, str]:
        """Labels with fixed values that every series of this scheme carries."""
        return dict(VLLM_LABELS) if self.scheme == "vllm" else {}
