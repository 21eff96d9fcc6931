"""vLLM's speculative-decoding counters, from the engine's `SpecDecodeStats`: drafts, draft
tokens, accepted tokens, and accepted tokens per draft position. From them a dashboard reads
the acceptance rate (accepted / draft tokens) and the mean acceptance length (1 + accepted /
drafts: the tokens a sequence gains per verifying step, the bonus token included). They exist
only when speculation is configured, as vLLM's do, so that a server without it publishes no
series that would only ever read 0."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from engine.stats import SpecDecodeStats
from server.metrics.names import MetricNames


class SpecDecodeMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        names: MetricNames,
        num_speculative_tokens: int,
        labels: list[str],
        values: tuple[str, ...],
    ) -> None:
        """`labels` / `values`: the label names and values every series of the server carries."""

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(names.name(name), doc, [*labels, *extra], registry=registry)

        self.drafts = counter(
            "spec_decode_num_drafts", "Drafts verified (one sequence's guessed tokens in a step)."
        ).labels(*values)
        self.draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(*values)
        self.accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(*values)
        self.per_position = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            ("position",),
        )
        self.values = values
        # Every position exists from the start, so that a rate over one never accepted reads 0
        # rather than no data.
        for position in range(num_speculative_tokens):
            self.per_position.labels(*values, str(position))

    def record(self, stats: SpecDecodeStats) -> None:
        self.drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.per_position.labels(*self.values, str(position)).inc(count)
