"""``aivedio bench e2e`` runs end to end with tiny rates, as the command the operator runs: the
deployment (two ``run --role all`` processes sharing the port, or the roles split), tasks through
the API held at the sandbox, signed webhooks, SSE clients, the naive reference. Every event
arrives and every stage of the chain is stamped; figures are printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STAGES = ("received", "committed", "applied", "relayed", "dispatched", "written", "read")


@pytest.mark.parametrize("split", [0, 1])
def test_e2e_bench_delivers_every_webhook_as_a_frame(
    service_urls: dict[str, str], split: int
) -> None:
    env = os.environ | {
        "AIVEDIO_DATABASE_URL": service_urls["database_url"],
        "AIVEDIO_REDIS_URL": service_urls["redis_url"],
        "AIVEDIO_NATS_URL": service_urls["nats_url"],
    }
    options = [
        "rates=20,40",
        "duration_s=1",
        "projects=2",
        "processes=2",
        f"split={split}",
        f"naive={1 - split}",  # the naive reference once is enough
        f"bus={'private' if split else 'configured'}",  # the shared NATS, a stream of its own
        "idle_s=0.2",
        "quiet_s=10",  # only waited for when a frame is missing
        "settle_s=60",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", "bench", "e2e", *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])

    assert figures["bench"] == "e2e"
    for key in ("rate_per_s", "p50_ms", "p99_ms", "cpu_us_per_event"):
        assert isinstance(figures[key], float), key
    assert "saturation_per_s" in figures and "naive_saturation_per_s" in figures
    assert figures["lost"] == figures["lost_total"] == 0
    if not split:
        assert isinstance(figures["naive_p99_ms"], float)
        assert figures["naive_lost_total"] == 0
        assert [s["lost"] for s in figures["steps"]["naive"]["many"]] == [0, 0]
    assert figures["many"]["lost_total"] == 0 and figures["many"]["projects"] == 2
    assert figures["procs"] == (2 + 8 if split else 2)
    # every stage of the chain carried its stamp, in both scenarios
    for head in (figures, figures["many"]):
        assert set(head["stages_ms"]) == set(STAGES)
        assert all(isinstance(head["stages_ms"][s], float) for s in STAGES)
    # CPU per event of every kind of process, read from /proc
    cpu = figures["cpu_us_per_event_by_process"]
    assert {"aivedio", "sandbox", "load", "clients", "total"} <= set(cpu)
    # the schedule let nothing be coalesced or superseded: no webhook was audited instead
    for steps in figures["steps"]["aivedio"].values():
        assert [s["asked"] for s in steps] == [20.0, 40.0]
        for step in steps:
            assert step["ignored"] == {} and step["superseded"] == 0
            assert step["accepted"] == step["sent"] > 0
            # the chain writes (the inbox insert, the apply, the relay's mark), batched
            assert step["pg_write_xacts_per_event"] > 0
    assert all(
        s["pg_write_xacts_per_event"] is None for s in figures["steps"]["naive"].get("one", [])
    )
