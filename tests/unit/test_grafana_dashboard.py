"""The Grafana dashboard of docs/deploy/grafana/aivedio.json queries only metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

# Every role's module and the bus adapters (loaded by the roles only when they connect): their
# imports register every metric.
import aivedio.bus.jetstream
import aivedio.roles  # noqa: F401

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "deploy" / "grafana" / "aivedio.json"
METRIC = re.compile(r"\baivedio_[a-z0-9_]+")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported_samples() -> set[str]:
    """Every sample name a scrape of this process can show for an aivedio metric."""
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("aivedio_"):
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def test_every_panel_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_samples()
    queried = 0
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = METRIC.findall(target["expr"])
            assert names, f"panel {panel['title']!r}: {target['expr']!r} names no aivedio metric"
            unknown = sorted(set(names) - exported)
            assert not unknown, f"panel {panel['title']!r} queries unknown metrics {unknown}"
            queried += 1
    assert queried >= 30


def test_the_dashboard_covers_the_seed_metrics() -> None:
    """Each metric of seed §12.11.6 (docs/reference/metrics.md) has a panel."""
    text = DASHBOARD.read_text()
    for name in (
        "aivedio_callbacks_accepted_total",
        "aivedio_callbacks_duplicate_total",
        "aivedio_callbacks_rejected_total",
        "aivedio_callback_store_seconds_bucket",
        "aivedio_inbox_lag_seconds_bucket",
        "aivedio_apply_observation_seconds_bucket",
        "aivedio_outbox_backlog",
        "aivedio_outbox_oldest_pending_age_seconds",
        "aivedio_outbox_relay_lag_seconds_bucket",
        "aivedio_dispatch_lag_seconds_bucket",
        "aivedio_bus_redeliveries_total",
        "aivedio_bus_dead_letters_total",
        "aivedio_poll_queries_total",
        "aivedio_poll_limiter_wait_seconds_bucket",
        "aivedio_gateway_connections",
        "aivedio_gateway_frames_written_total",
        "aivedio_gateway_slow_evictions_total",
        "aivedio_gateway_resets_total",
        "aivedio_gateway_gap_repairs_total",
        "aivedio_gateway_tailcheck_repairs_total",
        "aivedio_gateway_event_age_seconds_bucket",
    ):
        assert name in text, name


def test_the_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "aivedio"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
