"""``aivedio bench transitions`` runs end to end with tiny parameters (figures are not asserted)."""

from __future__ import annotations

import json

import pytest

from aivedio.bench import run_bench
from aivedio.config import Settings

KEYS = {
    "bench",
    "per_s",
    "ceiling_per_s",
    "ratio",
    "p50_ms",
    "p99_ms",
    "workers",
    "applied",
    "ignored",
}


@pytest.mark.parametrize(("batch", "effective"), [("", 4), ("batch=1", 1)])
def test_transitions_prints_the_json_line_last(
    admin_database_url: str, capsys: pytest.CaptureFixture[str], batch: str, effective: int
) -> None:
    """The default batch is capped at tasks / workers (4 here); ``batch=1`` is ``apply``."""
    settings = Settings(database_url=admin_database_url)
    options = ["tasks=12", "projects=2", "workers=3", "seconds=1", "pgbench_seconds=1"]
    options += [batch] if batch else []

    assert run_bench(settings, "transitions", options) == 0

    lines = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(lines[-1])
    assert KEYS <= set(figures)
    assert figures["bench"] == "transitions"
    assert figures["applied"] > 0
    assert figures["workers"] == 3
    assert figures["batch"] == effective
    assert figures["ceiling_per_s"] is None or figures["ceiling_per_s"] > 0
    assert any("pgbench" in line or "ceiling" in line for line in lines[:-1])


def test_unknown_benchmark_and_option_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(database_url="postgresql://unused@127.0.0.1:1/none")

    assert run_bench(settings, "nope", []) == 2
    assert run_bench(settings, "transitions", ["colour=blue"]) == 2
    assert run_bench(settings, "transitions", ["tasks"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err
    assert "unknown option(s) colour" in err
    assert "not key=value" in err
