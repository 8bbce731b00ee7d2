"""``aivedio bench ingest`` runs end to end with tiny parameters, with the server in this process
and as two processes sharing the port (SO_REUSEPORT): pgbench gave a ceiling, both phases got
204s, and every 204 has its committed row (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from aivedio.bench import run_bench
from aivedio.config import Settings


@pytest.mark.parametrize("server_processes", [1, 2])
def test_ingest_bench_accounts_for_every_callback(
    service_urls: dict[str, str], capsys: pytest.CaptureFixture[str], server_processes: int
) -> None:
    settings = Settings(database_url=service_urls["database_url"])
    options = [
        "seconds=1",
        "warmup=0.3",
        "connections=8",
        "pgbench_clients=2",
        f"server_processes={server_processes}",
    ]

    assert run_bench(settings, "ingest", options) == 0

    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["bench"] == "ingest"
    assert figures["server_processes"] == server_processes
    assert figures["ceiling_per_s"] > 0 and figures["per_s"] > 0
    assert figures["half_rate_per_s"] > 0
    assert figures["stored_rows"] == figures["answered_204"] > 0
    # pgbench and the max-rate phase alternate (2 runs each by default); the best of each counts
    assert len(figures["max_rate_runs"]) == len(figures["pgbench_runs"]["2"]) == 2
    assert figures["per_s"] == max(figures["max_rate_runs"])
    assert figures["ceiling_per_s"] == max(figures["pgbench_runs"]["2"])
    # CPU per callback by side, read from /proc (PostgreSQL: None only if it is not local)
    cpu = figures["cpu_us_per_callback"]
    assert cpu["servers"] > 0 and cpu["clients"] > 0
    assert cpu["postgres"] is None or cpu["postgres"] > 0
    assert figures["pgbench_client_cpu_us_per_tx"] > 0
