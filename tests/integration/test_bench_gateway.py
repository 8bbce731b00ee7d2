"""``aivedio bench connections`` and ``fanout`` run end to end with tiny numbers.

The gateway runs in its own process, the clients in two more; figures are not asserted, only the
JSON keys and that every client got its heartbeats and every event exactly once.
"""

from __future__ import annotations

import json

import pytest

from aivedio.bench import run_bench
from aivedio.config import Settings


def _settings(service_urls: dict[str, str]) -> Settings:
    return Settings(
        database_url=service_urls["database_url"],
        redis_url=service_urls["redis_url"],
        nats_url=service_urls["nats_url"],
    )


def _figures(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    lines = capsys.readouterr().out.strip().splitlines()
    figures: dict[str, object] = json.loads(lines[-1])
    return figures


def test_connections_holds_every_stream_with_heartbeats(
    service_urls: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["connections=50", "procs=2", "hold_s=3", "heartbeat_s=1", "settle_s=0.5"]

    assert run_bench(_settings(service_urls), "connections", options) == 0

    figures = _figures(capsys)
    assert {"bench", "connections", "rss_per_conn_kib", "heartbeats_on_time"} <= set(figures)
    assert figures["bench"] == "connections"
    assert figures["connections"] == 50
    assert figures["failed"] == 0
    assert figures["pings_per_conn_min"] >= 1  # type: ignore[operator]


def test_fanout_delivers_every_event_to_every_client(
    service_urls: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    options = [
        "clients=50",
        "procs=2",
        "events=3",
        "gap_s=0.1",
        "rate=10",
        "steps=2",
        "step_s=0.5",
        "pause_s=0.5",
    ]

    assert run_bench(_settings(service_urls), "fanout", options) == 0

    figures = _figures(capsys)
    assert {"bench", "clients", "p50_ms", "p99_ms", "frames_per_s"} <= set(figures)
    assert figures["bench"] == "fanout"
    assert figures["clients"] == 50
    assert figures["missing_frames"] == 0
    assert figures["duplicate_frames"] == 0
    assert figures["unexpected_frames"] == 0
