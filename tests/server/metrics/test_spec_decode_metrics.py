"""The speculative-decoding counters from synthetic engine stats, read back from the exposition
as Prometheus parses it: exact totals over two snapshots, one series per draft position (those
never accepted at 0), vLLM's names and labels under `--metrics-names vllm`, ours otherwise, and
nothing at all when speculation is off."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats, SpecDecodeStats
from server.metrics.collector import EngineMetrics
from server.metrics.names import MetricNames

MODEL = "spec-model"
FAMILIES = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)
# scheme -> (prefix of every spec-decode family, labels of every series)
SCHEMES = {
    "pagedserve": ("pagedserve:", {"model_name": MODEL}),
    "vllm": ("vllm:", {"model_name": MODEL, "engine": "0"}),
}


def metrics(scheme: str, num_speculative_tokens: int | None) -> EngineMetrics:
    names = MetricNames(scheme)  # type: ignore[arg-type]
    return EngineMetrics(
        CollectorRegistry(), MODEL, 16, 64, 128, names, None, num_speculative_tokens
    )


def snapshot(drafts: list[tuple[int, int]]) -> EngineStats:
    """Stats with these (draft tokens, accepted) drafts, counted as the engine counts them."""
    spec = SpecDecodeStats()
    for num_draft_tokens, num_accepted in drafts:
        spec.add(num_draft_tokens, num_accepted)
    return EngineStats(spec_decode=spec)


def exposed(m: EngineMetrics) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Spec-decode family -> its samples (name, labels, value), as Prometheus parses them; not
    the `_created` timestamps prometheus-client adds beside counters."""
    text = generate_latest(m.registry).decode()
    return {
        f.name: [(s.name, s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
        if "spec_decode" in f.name and not f.name.endswith("_created")
    }


@pytest.mark.parametrize("scheme", SCHEMES)
def test_exact_totals_after_two_snapshots_under_either_names(scheme: str) -> None:
    prefix, labels = SCHEMES[scheme]
    m = metrics(scheme, 4)
    # Drafts of up to 4 tokens; one sequence proposed fewer (no longer match in its text).
    m.record(snapshot([(4, 2), (4, 0), (3, 3)]))
    m.record(EngineStats())  # an idle step: nothing speculated
    m.record(snapshot([(4, 1), (2, 2)]))

    families = exposed(m)
    assert set(families) == {prefix + name for name in FAMILIES}
    totals = {
        "spec_decode_num_drafts": 5,
        "spec_decode_num_draft_tokens": 4 + 4 + 3 + 4 + 2,
        "spec_decode_num_accepted_tokens": 2 + 0 + 3 + 1 + 2,
    }
    for name, want in totals.items():
        [(sample, sample_labels, got)] = families[prefix + name]
        assert (sample, sample_labels, got) == (prefix + name + "_total", labels, want)
    per_position = {
        sample_labels["position"]: got
        for sample, sample_labels, got in families[prefix + FAMILIES[3]]
    }
    # Position i counts the drafts that kept at least i + 1 tokens; position 3 never did.
    assert per_position == {"0": 4, "1": 3, "2": 1, "3": 0}
    assert sum(per_position.values()) == totals["spec_decode_num_accepted_tokens"]
    for sample, sample_labels, _ in families[prefix + FAMILIES[3]]:
        assert sample == prefix + FAMILIES[3] + "_total"
        assert {k: v for k, v in sample_labels.items() if k != "position"} == labels


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_position_reads_zero_before_any_draft(scheme: str) -> None:
    prefix, _ = SCHEMES[scheme]
    families = exposed(metrics(scheme, 3))
    assert [got for *_, got in families[prefix + "spec_decode_num_drafts"]] == [0]
    positions = {
        sample_labels["position"]: got for _, sample_labels, got in families[prefix + FAMILIES[3]]
    }
    assert positions == {"0": 0, "1": 0, "2": 0}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_spec_decode_series_without_speculation(scheme: str) -> None:
    m = metrics(scheme, None)
    m.record(snapshot([(4, 2)]))  # never happens without speculation; still not published
    assert exposed(m) == {}
