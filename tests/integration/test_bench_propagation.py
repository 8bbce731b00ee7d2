"""``aivedio bench propagation`` runs end to end with tiny parameters: every event is accounted
for in both phases, with one apply per event and with ``apply_many`` batches (figures are not
asserted)."""

from __future__ import annotations

import json

import pytest

from aivedio.bench import run_bench
from aivedio.config import Settings


@pytest.mark.parametrize("writer_batch", [1, 5])
def test_propagation_accounts_for_every_event(
    service_urls: dict[str, str], capsys: pytest.CaptureFixture[str], writer_batch: int
) -> None:
    settings = Settings(
        database_url=service_urls["database_url"],
        redis_url=service_urls["redis_url"],
        nats_url=service_urls["nats_url"],
    )
    options = [
        "events=300",
        "tasks=30",
        "relays=2",
        "rate=100",
        "seconds=1",
        "latency_tasks=20",
        "projects=2",
        "writers=2",
        "probe=5",
        f"writer_batch={writer_batch}",
    ]

    assert run_bench(settings, "propagation", options) == 0

    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["bench"] == "propagation"
    assert (figures["events"], figures["missing"], figures["duplicates_at_subscriber"]) == (
        300,
        0,
        0,
    )
    assert figures["out_of_order"] == 0
    assert figures["latency_events"] == 100
    assert figures["latency_missing"] == 0
    # Measured from COMMIT returned and from COMMIT sent: the second is never the smaller.
    assert figures["p50_ms_upper"] >= figures["p50_ms"] > 0
    assert figures["p99_ms_upper"] >= figures["p99_ms"]
    assert figures["ok"] is True
