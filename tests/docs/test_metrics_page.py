"""docs/metrics.md names every metric the server can publish and every panel of the Grafana
dashboard, so that a new one cannot go undocumented."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from server.metrics.collector import EngineMetrics
from server.metrics.names import PREFIX

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pagedserve.json"


def published_families() -> set[str]:
    """Every metric family, with every optional part on (LoRA, speculation, images, KV offload)."""
    registry = CollectorRegistry()
    EngineMetrics(
        registry,
        "m",
        16,
        64,
        2048,
        max_loras=2,
        num_speculative_tokens=3,
        images=True,
        kv_offload_tiers=("host", "disk"),
    )
    return {family.name for family in registry.collect()}


def test_every_metric_is_on_the_metrics_page() -> None:
    page = PAGE.read_text()
    families = published_families()
    assert len(families) > 30 and all(name.startswith(PREFIX) for name in families)
    # Counters are documented as exposed, with the `_total` the client library appends.
    missing = [
        name
        for name in sorted(families)
        if f"`{name.removeprefix(PREFIX)}`" not in page
        and f"`{name.removeprefix(PREFIX)}_total" not in page
        and f"`{name.removeprefix(PREFIX)}{{" not in page
    ]
    assert not missing, f"add a row to docs/metrics.md for: {missing}"


def test_every_dashboard_panel_is_on_the_metrics_page() -> None:
    page = PAGE.read_text()
    table = page[page.index("| panel | what it shows |") :]
    panels = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert len(panels) > 20
    missing = [title for title in panels if f"\n| {title} |" not in table]
    assert not missing, f"add a row to the dashboard table of docs/metrics.md for: {missing}"
