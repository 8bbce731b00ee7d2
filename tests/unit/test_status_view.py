"""``aivedio status``'s arithmetic and rendering, without servers."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from aivedio.status import Scrape, figures, quantile, render

METRICS = """\
# TYPE aivedio_inbox_lag_seconds histogram
aivedio_inbox_lag_seconds_bucket{le="0.01"} 10.0
aivedio_inbox_lag_seconds_bucket{le="0.1"} 90.0
aivedio_inbox_lag_seconds_bucket{le="1.0"} 100.0
aivedio_inbox_lag_seconds_bucket{le="+Inf"} 100.0
aivedio_inbox_lag_seconds_count 100.0
aivedio_inbox_lag_seconds_sum 3.0
# TYPE aivedio_gateway_connections gauge
aivedio_gateway_connections{transport="sse"} 3.0
aivedio_gateway_connections{transport="ws"} 1.0
# TYPE aivedio_gateway_queued_events gauge
aivedio_gateway_queued_events 5.0
# TYPE aivedio_bus_dead_letters counter
aivedio_bus_dead_letters_total{group="dispatcher",reason="malformed",topic="task.status"} 2.0
# TYPE aivedio_role_up gauge
aivedio_role_up{loop="relay",role="relay"} 0.0
aivedio_role_up{loop="hub",role="gateway"} 1.0
"""


def scraped(text: str, at: float) -> Scrape:
    s = Scrape(at)
    s.add(text)
    return s


def test_quantile_interpolates_inside_the_bucket_as_prometheus_does() -> None:
    buckets = {0.01: 10.0, 0.1: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.01 + 0.09 * (50 - 10) / 80)
    assert quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * (99 - 90) / 10)
    assert quantile(0.05, buckets) == pytest.approx(0.005)
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {0.1: 1.0, float("inf"): 10.0}) == 0.1  # overflow: its lower edge


def test_figures_sum_the_endpoints_and_take_the_interval_once_there_are_two_scrapes() -> None:
    first = scraped(METRICS, 100.0)
    first.add(METRICS)  # a second process with the same figures
    data = figures(None, first)
    assert data["connections"] == {"sse": 6, "ws": 2}
    assert data["queued_events"] == 10
    assert data["counters"]["bus dead letters"] == 4
    assert data["roles_down"] == ["relay/relay", "relay/relay"]
    assert data["lags"]["inbox lag"]["count"] == 200
    later = scraped(
        METRICS.replace('le="1.0"} 100.0', 'le="1.0"} 110.0').replace(
            'le="+Inf"} 100.0', 'le="+Inf"} 110.0'
        ),
        102.0,
    )
    later.add(
        METRICS.replace('le="1.0"} 100.0', 'le="1.0"} 110.0').replace(
            'le="+Inf"} 100.0', 'le="+Inf"} 110.0'
        )
    )
    windowed = figures(None, later, first)
    assert windowed["window"] == "last 2s"
    lag = windowed["lags"]["inbox lag"]
    assert lag["count"] == 20  # the 20 observations of the interval, all in (0.1, 1.0]
    assert lag["p50_s"] is not None and 0.1 < lag["p50_s"] <= 1.0
    restarted = figures(None, first, later)  # counts went down: a restart, use the totals
    assert restarted["lags"]["inbox lag"]["count"] == 200


def test_a_frame_shows_every_section() -> None:
    database = {
        "inbox_pending": 4,
        "inbox_dead": 1,
        "outbox_pending": 7,
        "outbox_oldest_s": 12.5,
        "outbox_dead": 0,
        "submit_pending": 2,
        "cancel_pending": 0,
        "media_pending": 3,
        "tasks_in_flight": {"running": 5},
        "reconciliation_open": {"contradictory_terminal": 1},
    }
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None)
    data = figures(database, scraped(METRICS, 1.0))
    data["metrics_unreachable"] = ["http://127.0.0.1:1/metrics"]
    console.print(render(data))
    text = out.getvalue()
    for expected in (
        "backlogs",
        "callback inbox",
        "outbox (oldest 12.5 s)",
        "in-flight tasks",
        "running",
        "contradictory_terminal",
        "connections",
        "queued events",
        "inbox lag",
        "bus dead letters",
        "roles down: relay/relay",
        "metrics unreachable: http://127.0.0.1:1/metrics",
    ):
        assert expected in text, expected
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(figures(None, Scrape(1.0))))
    assert "PostgreSQL: unreachable" in out.getvalue()
