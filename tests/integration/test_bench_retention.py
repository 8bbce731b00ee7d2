"""``aivedio bench retention`` runs end to end at a CI size: one day is dropped, every figure
of the operator contract is in the JSON line (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from aivedio.bench import run_bench
from aivedio.config import Settings


def test_retention_bench_runs_at_a_small_size(
    service_urls: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(
        database_url=service_urls["database_url"],
        redis_url=service_urls["redis_url"],
        nats_url=service_urls["nats_url"],
    )
    options = [
        "events=6000",
        "days=3",
        "projects=4",
        "tasks=100",
        "replay=100",
        "samples=5",
        "writers=2",
        "readers=1",
        "probe_s=0.3",
        "inbox_rows=200",
    ]

    assert run_bench(settings, "retention", options) == 0

    out = capsys.readouterr().out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["bench"] == "retention"
    assert figures["events"] == 6000
    assert figures["drop_partition_events"] == 2000
    assert figures["floors_raised"] == 4
    for key in ("bytes_per_event", "replay_p99_ms", "drop_partition_ms", "max_writer_block_ms"):
        assert isinstance(figures[key], float), key
    for query in ("replay", "snapshot", "inbox claim", "outbox claim"):
        assert f"EXPLAIN (ANALYZE, BUFFERS) {query}" in out
    assert "Index Scan using task_events_p" in out  # the replay uses the partitions' keys


def test_retention_bench_refuses_a_size_it_cannot_fill(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(Settings(), "retention", ["days=1"]) == 2
    assert "days must be at least 2" in capsys.readouterr().err
