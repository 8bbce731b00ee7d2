"""``bench e2e``: the printed tables and the JSON line (keys in docs/reference/benchmarks.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from aivedio.bench.common import rounded
from aivedio.bench.e2e_run import ScenarioFigures, StepFigures
from aivedio.bench.e2e_schedule import STAGES, saturation

GROUPS = ("aivedio", "naive", "postgres", "nats", "redis", "sandbox", "load", "clients")
TITLES = {"one": "one project", "many": "many projects"}
TOP_STATEMENTS = 8  # printed one by one; the total line and the JSON count them all


def _f(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def at_rate(steps: Sequence[StepFigures], rate: float) -> StepFigures | None:
    """The step whose asked rate is nearest ``rate`` (the higher one on a tie)."""
    if not steps:
        return None
    return min(steps, key=lambda s: (abs(s.asked - rate), -s.asked))


def _table(system: str, scenario: str, fig: ScenarioFigures, limit_ms: float) -> None:
    idle = ", ".join(f"{k} {v:.2f}" for k, v in fig.idle_cores.items() if v >= 0.005)
    print(
        f"\n{system}, {TITLES[scenario]}: {fig.tasks} tasks in {fig.projects} project(s), "
        f"{fig.streams} SSE stream(s); one task's webhooks >= {fig.min_gap_s:.2f} s apart at "
        f"the top rate; idle CPU (cores): {idle or 'none'}"
    )
    groups = [g for g in GROUPS if any(g in s.cpu_us() for s in fig.steps)]
    print(
        "  asked/s   got/s    p50 ms    p90 ms    p99 ms    max ms  lost (superseded)  "
        f"sender p99 lag ms  CPU us/event: total {' '.join(groups)}  polls/s"
    )
    for s in fig.steps:
        cpu = s.cpu_us()
        lat = s.latency
        print(
            f"  {s.asked:7.0f} {s.achieved:7.1f} {_f(lat['p50']):>9} {_f(lat['p90']):>9} "
            f"{_f(lat['p99']):>9} {_f(lat['max']):>9}  {s.lost:>5} ({s.superseded})"
            f"  {_f(s.sender_lag_p99_ms, 2):>8}  {cpu['total']:7.0f} "
            + " ".join(f"{cpu.get(g, 0.0):.0f}" for g in groups)
            + f"  {s.polls / max(s.window_s, 1e-9):.0f}"
        )
    roles = sorted({k for s in fig.steps for k in s.cpu_s if k.startswith("aivedio-")})
    if len(roles) > 1:
        names = ", ".join(r.removeprefix("aivedio-") for r in roles)
        print(f"  CPU us/event per aivedio process ({names}), and of the PostgreSQL backends "
              "serving it:")  # fmt: skip
        for s in fig.steps:
            cpu = s.cpu_us()
            cells = [f"{cpu.get(r, 0.0):.0f} (pg {cpu.get('pg:' + r, 0.0):.0f})" for r in roles]
            print(f"  {s.asked:7.0f}  " + "  ".join(cells))
    if any(s.stages for s in fig.steps):
        print("  where the time goes, p50 (p99) ms per stage:")
        print("  asked/s  " + "  ".join(f"{name:>17}" for name in STAGES) + "  untimed  ignored")
        for s in fig.steps:
            cells = [f"{_f(s.stages[n]['p50'], 2)} ({_f(s.stages[n]['p99'], 1)})" for n in STAGES]
            print(
                f"  {s.asked:7.0f}  "
                + "  ".join(f"{c:>17}" for c in cells)
                + f"  {s.untimed:>7}  {s.ignored or '-'}"
            )
    for s in fig.steps:
        notes = _notes(s)
        if notes:
            print(f"  at {s.asked:g}/s: " + "; ".join(notes))
    for s in fig.steps:
        _print_statements(s)
    sat = saturation([s.rate_result() for s in fig.steps], limit_ms)
    print(f"  saturation (p99 <= {limit_ms:g} ms, nothing lost): {_f(sat or math.nan, 0)}/s")
    if fig.stopped:
        print(f"  ramp stopped: {fig.stopped}")


def _print_statements(s: StepFigures) -> None:
    """The step's statements by PostgreSQL execution time (when the server keeps them)."""
    if not s.statements:
        return
    sent = max(s.sent, 1)
    print(
        f"  PostgreSQL statements at {s.asked:g}/s, the step and its drain "
        "(pg_stat_statements, execution time only):"
    )
    print("    exec us/webhook  calls/webhook  rows/call  statement")
    for st in s.statements[:TOP_STATEMENTS]:
        print(
            f"    {st.exec_ms * 1000 / sent:15.1f}  {st.calls / sent:13.3f}  "
            f"{st.rows / max(st.calls, 1):9.1f}  {st.name}"
        )
    calls = sum(st.calls for st in s.statements)
    exec_ms = sum(st.exec_ms for st in s.statements)
    print(
        f"    {exec_ms * 1000 / sent:15.1f}  {calls / sent:13.3f}  {'':9}  "
        f"all {len(s.statements)} statements"
    )


def _notes(s: StepFigures) -> list[str]:
    """What else one step's line of the table says: transactions, resends, refusals, losses."""
    notes = []
    if s.pg_write_xacts is not None:
        notes.append(
            f"{s.pg_write_xacts} PostgreSQL write transactions in the step and its drain "
            f"({s.pg_write_xacts / max(s.sent, 1):.2f} per webhook; the whole server's)"
        )
    if s.retried:
        notes.append(f"{s.retried} webhooks sent again (a non-2xx answer or a closed connection)")
    if s.refused:
        notes.append(f"final answers not 204: {s.refused} (0: none)")
    if s.lost_where:
        notes.append(f"lost, how far they got: {s.lost_where}")
    return notes


def print_figures(figures: dict[str, Any]) -> None:
    opts = figures["options"]
    print(
        f"\nschedule: every webhook moves its task's progress by {figures['points']} points "
        f"(AIVEDIO_COALESCE_MIN_POINTS): a progress change of at least min_points is always "
        f"written (transitions._progress_only), the first one of a task is a status change; "
        f"at most {figures['per_task']} webhooks per task, round robin over the tasks, so one "
        f"task's webhooks are tasks/rate s apart and cannot overtake each other"
    )
    bus = opts.get("bus_adapter", "jetstream")
    where = "AIVEDIO_REDIS_URL" if bus == "redis-streams" else f"{opts.get('bus')} NATS"
    print(
        f"deployment: {len(figures.get('layout', []))} processes: {figures.get('layout')};"
        f" bus {bus} ({where})"
    )
    start, end = figures["load"], figures.get("load_end", (math.nan,) * 3)
    print(f"load average (1, 5, 15 min): at the start {start}, at the end {end}")
    for system in ("aivedio", "naive"):
        for scenario, fig in figures[system].items():
            _table(system, scenario, fig, opts["p99_limit_ms"])
    ratios = _ratios(figures)
    if ratios:
        print(
            "\nratios aivedio / naive: " + ", ".join(f"{k} {_f(v, 2)}" for k, v in ratios.items())
        )


def _headline(fig: ScenarioFigures | None, rate: float, limit_ms: float) -> dict[str, Any]:
    if fig is None:
        return {}
    step = at_rate(fig.steps, rate)
    out: dict[str, Any] = {
        "saturation_per_s": rounded(
            saturation([s.rate_result() for s in fig.steps], limit_ms) or math.nan, 1
        ),
        "lost_total": sum(s.lost for s in fig.steps),
    }
    if step is None:
        return out
    cpu = step.cpu_us()
    return out | {
        "at_rate": step.asked,
        "rate_per_s": rounded(step.achieved, 1),
        "p50_ms": rounded(step.latency["p50"]),
        "p90_ms": rounded(step.latency["p90"]),
        "p99_ms": rounded(step.latency["p99"]),
        "max_ms": rounded(step.latency["max"]),
        "lost": step.lost,
        "cpu_us_per_event": rounded(cpu["total"], 1),
        "cpu_us_per_event_by_process": {k: rounded(v, 1) for k, v in cpu.items()},
        "stages_ms": {k: rounded(v["p50"]) for k, v in step.stages.items()},
        "stages_p99_ms": {k: rounded(v["p99"]) for k, v in step.stages.items()},
        "pg_write_xacts_per_event": _per_event(step.pg_write_xacts, step.sent),
        "pg_exec_us_per_event": _statements(step),
        "pg_calls_per_event": _calls(step),
    }


def _statements(step: StepFigures) -> dict[str, float | None] | None:
    """Execution microseconds per webhook by statement name (pg_stat_statements), if kept."""
    if step.statements is None:
        return None
    return {st.name: rounded(st.exec_ms * 1000 / max(step.sent, 1), 1) for st in step.statements}


def _calls(step: StepFigures) -> float | None:
    """Statements per webhook, all of them (pg_stat_statements), if kept."""
    if step.statements is None:
        return None
    return _per_event(sum(st.calls for st in step.statements), step.sent)


def _per_event(count: int | None, sent: int) -> float | None:
    return rounded(count / sent, 3) if count is not None and sent else None


def _ratios(figures: dict[str, Any]) -> dict[str, float]:
    opts = figures["options"]
    out: dict[str, float] = {}
    for scenario in figures["aivedio"]:
        ours = _headline(figures["aivedio"].get(scenario), opts["at_rate"], opts["p99_limit_ms"])
        naive = _headline(figures["naive"].get(scenario), opts["at_rate"], opts["p99_limit_ms"])
        for key in ("p99_ms", "saturation_per_s"):
            a, b = ours.get(key), naive.get(key)
            if a is not None and b:
                out[f"{scenario}_{key.removesuffix('_ms').removesuffix('_per_s')}"] = a / b
    return out


def _steps(fig: ScenarioFigures) -> list[dict[str, Any]]:
    return [
        {
            "asked": s.asked,
            "achieved": rounded(s.achieved, 1),
            **{f"{k}_ms": rounded(v) for k, v in s.latency.items()},
            "lost": s.lost,
            "superseded": s.superseded,
            "sent": s.sent,
            "accepted": s.accepted,
            "cpu_us_per_event": {k: rounded(v, 1) for k, v in s.cpu_us().items()},
            "stages_ms": {k: rounded(v["p50"]) for k, v in s.stages.items()},
            "untimed": s.untimed,
            "ignored": s.ignored,
            "retried": s.retried,
            "refused": {str(k): v for k, v in s.refused.items()},
            "lost_where": s.lost_where,
            "polls": s.polls,
            "pg_write_xacts_per_event": _per_event(s.pg_write_xacts, s.sent),
            "pg_exec_us_per_event": _statements(s),
            "pg_calls_per_event": _calls(s),
        }
        for s in fig.steps
    ]


def json_figures(figures: dict[str, Any]) -> dict[str, Any]:
    opts = figures["options"]
    rate, limit = opts["at_rate"], opts["p99_limit_ms"]
    ours, naive = figures["aivedio"], figures["naive"]
    first = "one" if "one" in ours else next(iter(ours), None)
    head = _headline(ours.get(first), rate, limit) if first else {}
    naive_head = _headline(naive.get(first), rate, limit) if first else {}
    out: dict[str, Any] = {"bench": "e2e", "scenario": first, **head}
    out["lost_total"] = sum(s.lost for fig in ours.values() for s in fig.steps)
    out["procs"] = len(figures.get("layout", []))
    out["layout"] = figures.get("layout", [])
    for key in ("rate_per_s", "p50_ms", "p99_ms", "lost", "saturation_per_s", "cpu_us_per_event"):
        out[f"naive_{key}"] = naive_head.get(key)
    out["naive_lost_total"] = sum(s.lost for fig in naive.values() for s in fig.steps)
    if "many" in ours:
        out["many"] = _headline(ours["many"], rate, limit) | {"projects": opts["projects"]}
    if "many" in naive:
        out["naive_many"] = _headline(naive["many"], rate, limit)
    out["ratios"] = {k: rounded(v) for k, v in _ratios(figures).items()}
    out["steps"] = {
        system: {scenario: _steps(fig) for scenario, fig in figures[system].items()}
        for system in ("aivedio", "naive")
    }
    out["tasks"] = {s: fig.tasks for s, fig in ours.items()}
    out["points"] = figures["points"]
    out["load_average"] = [round(x, 2) for x in figures["load"]]
    out["load_average_end"] = [round(x, 2) for x in figures.get("load_end", ())]
    out["cpus"] = figures["cpus"]
    out["options"] = opts
    return out
