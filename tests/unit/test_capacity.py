"""``aivedio capacity``: the seed's Little's-law plan from measured figures (pure arithmetic)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from aivedio.bench.common import BenchUsageError
from aivedio.capacity import Options, last_json_line, plan, run_capacity

E2E = {
    "bench": "e2e",
    "rate_per_s": 1000.0,
    "p99_ms": 40.0,
    "lost": 0,
    "procs": 2,
    "layout": ["aivedio-0-api,callbacks,gateway", "aivedio-1-inbox"],
    "saturation_per_s": 1500.0,
    "pg_write_xacts_per_event": 0.8,
    "cpu_us_per_event_by_process": {
        "aivedio-0-api,callbacks,gateway": 300.0,
        "aivedio-1-inbox": 200.0,
        "aivedio": 500.0,
        "postgres": 400.0,
        "nats": 100.0,
        "redis": 10.0,
        "total": 1100.0,
    },
}


def test_the_seeds_example_by_littles_law() -> None:
    result = plan(Options(), E2E)
    w = result["workload"]
    assert w["in_flight"] == 7200  # 60 tasks/s x 120 s
    assert w["events_per_s_peak"] == 1080  # 60 x 6 events x 3
    assert w["poll_qps_if_every_task_polled"] == 480  # 7,200 / 15 s (seed 12.11.2)
    assert w["heartbeats_per_s"] == 4000  # 100,000 / 25 s (seed 12.11.3)
    assert w["egress_bytes_per_s"] == pytest.approx(1080 * 1.3 * 500 + 4000 * 150)


def test_cores_processes_and_transactions_come_from_the_measured_costs() -> None:
    result = plan(Options(events_per_s=2000, utilization=0.5), E2E)
    assert result["servers"]["postgres"]["cores"] == pytest.approx(400 * 2000 / 1e6 / 0.5)
    assert result["cores"] == pytest.approx((500 + 400 + 100 + 10) * 2000 / 1e6 / 0.5)
    assert result["roles"]["inbox"]["processes"] == 1  # 0.8 cores
    assert result["roles"]["api,callbacks,gateway"]["processes"] == 2  # 1.2 cores
    assert result["postgres_transactions"]["per_s"] == pytest.approx(1600)
    assert "pg_write_xacts_per_event" in result["postgres_transactions"]["from"]
    assert result["nats"]["messages_per_s"] == 2000 * 4  # one publish, three groups
    progress = plan(Options(events_per_s=2000, progress_share=0.75), E2E)["nats"]
    assert progress["messages_per_s"] == 2000 * (1 + 0.25 * 3 + 0.75)  # progress: dispatcher
    assert any("saturation" in w for w in result["warnings"])  # 2,000/s > 1,500/s measured


def test_gateway_nodes_by_memory_and_by_frames_plus_a_spare() -> None:
    connections = {"bench": "connections", "rss_per_conn_kib": 30.0}
    fanout = {"bench": "fanout", "frames_per_s": 1000.0}
    g = plan(Options(), E2E, connections, fanout)["gateway"]
    # 100,000 x 30 KiB = 2.86 GiB over 4 GiB x 0.6 per node (seed 12.11.3's example)
    assert g["nodes_by_memory"] == math.ceil(100_000 * 30 / (4 * 1024 * 1024 * 0.6))
    assert g["nodes_by_frames"] == math.ceil((1080 * 1.3 + 4000) / (1000 * 0.6))
    assert g["nodes"] == max(g["nodes_by_memory"], g["nodes_by_frames"]) + 1


def test_unmeasured_figures_are_unknown_not_guessed() -> None:
    result = plan(Options(), {**E2E, "pg_write_xacts_per_event": None})
    assert result["gateway"]["nodes"] is None
    assert "bench connections" in result["gateway"]["memory_from"]
    assert result["postgres_transactions"]["per_s"] is None


def test_a_saturated_measurement_is_flagged() -> None:
    warnings = plan(Options(), {**E2E, "p99_ms": 900.0})["warnings"]
    assert any("not keeping up" in w for w in warnings)


def test_the_cli_reads_the_last_json_line_and_prints_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "e2e.txt"
    path.write_text("a table\nmore\n" + json.dumps(E2E) + "\n")
    assert run_capacity([f"e2e={path}", "tasks_per_s=10"]) == 0
    out = last_json_line(capsys.readouterr().out)
    assert out["capacity"] == "plan"
    assert out["workload"]["in_flight"] == 1200


def test_usage_errors() -> None:
    with pytest.raises(BenchUsageError, match="exactly one"):
        run_capacity([])
    with pytest.raises(BenchUsageError, match="cannot read"):
        run_capacity(["e2e=/nonexistent/file"])
    with pytest.raises(BenchUsageError, match="unknown option"):
        run_capacity(["e2e=x", "bogus=1"])
