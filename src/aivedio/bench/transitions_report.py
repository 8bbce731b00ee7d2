"""The report of ``aivedio bench transitions``: figures side by side, then the JSON line."""

from __future__ import annotations

from aivedio.bench.common import percentile, print_json_line, rounded
from aivedio.bench.transitions_options import ApplyFigures, Options, PgbenchFigures
from aivedio.bench.transitions_pgbench import NO_PGBENCH

# -- report ---------------------------------------------------------------------------------------


def _report(
    opts: Options, ours: ApplyFigures, pg: PgbenchFigures | None, pg_error: str | None
) -> int:
    p50 = percentile(ours.latencies_ms, 50)
    p99 = percentile(ours.latencies_ms, 99)
    call = "apply" if opts.batch == 1 else f"apply_many (batch {opts.batch})"
    print(
        f"  ours    StateService.{call}: {ours.per_s:9.1f} applied/s"
        f"  p50 {p50:.2f} ms  p99 {p99:.2f} ms per call"
        f"  (applied {ours.applied}, ignored {ours.ignored} in {ours.seconds:.1f} s;"
        f" {ours.cpu_us_per_observation:.0f} us CPU per observation in this process)"
    )
    if ours.exhausted:
        print("  note: every task reached 100 % before the time was up; give more tasks=")
    ratio = float("nan")
    if pg is not None:
        ceiling = pg.tps * opts.batch  # observations per second
        ratio = ours.per_s / ceiling if ceiling > 0 else float("nan")
        latency = f"{pg.latency_avg_ms:.2f} ms" if pg.latency_avg_ms is not None else "?"
        print(
            f"  ceiling pgbench, same SQL:  {pg.tps * opts.batch:9.1f} observations/s"
            f" ({pg.tps:.1f} tx/s of {opts.batch})  latency avg {latency}"
            f"  (transactions {pg.transactions}, failed {pg.failed}; {pg.command})"
        )
        print(f"  ratio ours / ceiling: {ratio:.2f}")
    else:
        print(f"  ceiling: none ({pg_error})")
    print_json_line(
        {
            "bench": "transitions",
            "per_s": rounded(ours.per_s, 1),
            "ceiling_per_s": rounded(pg.tps * opts.batch, 1) if pg is not None else None,
            "ratio": rounded(ratio),
            "p50_ms": rounded(p50),
            "p99_ms": rounded(p99),
            "workers": opts.workers,
            "batch": opts.batch,
            "applied": ours.applied,
            "ignored": ours.ignored,
            "tasks": opts.tasks,
            "projects": opts.projects,
            "seconds": rounded(ours.seconds, 2),
            "cpu_us_per_obs": rounded(ours.cpu_us_per_observation, 1),
            "pgbench_latency_avg_ms": pg.latency_avg_ms if pg is not None else None,
        }
    )
    # No pgbench on this machine is not a failure of the run; pgbench failing is.
    return 0 if pg is not None or pg_error == NO_PGBENCH else 1
