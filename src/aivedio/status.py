"""``aivedio status``: a live terminal view of one deployment, from PostgreSQL and ``/metrics``.

PostgreSQL gives what is true for the whole deployment: backlogs (inbox, outbox, submit and
cancel intents, media operations), in-flight tasks by status, dead letters and open
reconciliation items. Each ``/metrics`` endpoint gives what its process sees: open connections
by transport, lags (p50 / p99 estimated from the histogram buckets, over the last interval once
two scrapes were taken, since the process started before), bus redeliveries and dead letters,
role loops that are down. Several endpoints (one per process) are summed.

``--once`` prints one frame, then one JSON line with the same figures, and exits (0, or 1 when
the database cannot be read).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from aivedio.domain.statuses import STATUS_TABLE

__all__ = [
    "Scrape",
    "collect_database",
    "figures",
    "quantile",
    "render",
    "run_status",
    "scrape",
]

IN_FLIGHT = sorted(str(s) for s, info in STATUS_TABLE.items() if not info.terminal)

DATABASE_SQL = {
    "inbox_pending": "SELECT count(*) FROM provider_callback_inbox"
    " WHERE process_status IN ('pending', 'retry', 'orphan')",
    "inbox_dead": "SELECT count(*) FROM provider_callback_inbox WHERE process_status = 'dead'",
    "outbox_pending": "SELECT count(*) FROM outbox_events WHERE publish_status = 'pending'",
    "outbox_oldest_s": "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8"
    " FROM outbox_events WHERE publish_status = 'pending'",
    "outbox_dead": "SELECT count(*) FROM outbox_events WHERE publish_status = 'dead'",
    "submit_pending": "SELECT count(*) FROM submit_intents WHERE state IN ('pending', 'sending')",
    "cancel_pending": "SELECT count(*) FROM cancel_intents WHERE state IN ('pending', 'sending')",
    "media_pending": "SELECT count(*) FROM media_operations WHERE state IN ('pending', 'running')",
}
TASKS_SQL = (
    "SELECT status, count(*) AS n FROM generation_tasks WHERE status = ANY($1::text[])"
    " GROUP BY status"
)
RECONCILE_SQL = (
    "SELECT kind, count(*) AS n FROM reconciliation_items WHERE state = 'open' GROUP BY kind"
)

# (label, histogram) of the lags shown, in chain order.
LAGS = (
    ("webhook -> inbox row", "aivedio_callback_store_seconds"),
    ("inbox lag", "aivedio_inbox_lag_seconds"),
    ("apply", "aivedio_apply_observation_seconds"),
    ("relay lag", "aivedio_outbox_relay_lag_seconds"),
    ("dispatcher lag", "aivedio_dispatch_lag_seconds"),
    ("event age at the socket", "aivedio_gateway_event_age_seconds"),
)
COUNTERS = (
    ("bus redeliveries", "aivedio_bus_redeliveries_total"),
    ("bus dead letters", "aivedio_bus_dead_letters_total"),
    ("callbacks rejected", "aivedio_callbacks_rejected_total"),
    ("slow evictions", "aivedio_gateway_slow_evictions_total"),
    ("gap repairs", "aivedio_gateway_gap_repairs_total"),
    ("tail repairs", "aivedio_gateway_tailcheck_repairs_total"),
)


@dataclass
class Scrape:
    """What the ``/metrics`` endpoints answered at one moment (summed over endpoints)."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append((sample.labels, sample.value))

    def total(self, name: str, **labels: str) -> float:
        return sum(
            value for have, value in self.samples.get(name, []) if labels.items() <= have.items()
        )

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for have, value in self.samples.get(name, []):
            key = have.get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def buckets(self, histogram: str) -> dict[float, float]:
        """Cumulative counts by upper bound, summed over labels and endpoints."""
        out: dict[float, float] = {}
        for have, value in self.samples.get(histogram + "_bucket", []):
            bound = float(have["le"])
            out[bound] = out.get(bound, 0.0) + value
        return out

    def down(self) -> list[str]:
        return sorted(
            f"{have.get('role', '?')}/{have.get('loop', '?')}"
            for have, value in self.samples.get("aivedio_role_up", [])
            if value == 0
        )


async def scrape(urls: Sequence[str], client: httpx.AsyncClient) -> Scrape:
    result = Scrape(time.time())
    for url in urls:
        try:
            response = await client.get(url)
            response.raise_for_status()
        except httpx.HTTPError:
            result.unreachable.append(url)
            continue
        result.add(response.text)
    return result


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile`` over cumulative ``buckets`` (upper bound -> count): linear
    interpolation inside the bucket, as Prometheus does; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # in the overflow bucket: its lower edge, as Prometheus answers
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return bounds[-1]


async def collect_database(conn: asyncpg.Connection) -> dict[str, Any]:
    """The deployment-wide figures (read-only, one snapshot)."""
    out: dict[str, Any] = {}
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        for name, sql in DATABASE_SQL.items():
            value = await conn.fetchval(sql)
            out[name] = round(float(value), 1) if name.endswith("_s") else int(value)
        rows = await conn.fetch(TASKS_SQL, IN_FLIGHT)
        out["tasks_in_flight"] = {r["status"]: int(r["n"]) for r in rows}
        rows = await conn.fetch(RECONCILE_SQL)
        out["reconciliation_open"] = {r["kind"]: int(r["n"]) for r in rows}
    return out


def _delta(now: dict[float, float], before: dict[float, float] | None) -> dict[float, float]:
    if before is None:
        return now
    delta = {bound: count - before.get(bound, 0.0) for bound, count in now.items()}
    if any(v < 0 for v in delta.values()):  # a process restarted: its counts began again
        return now
    return delta


def figures(
    database: dict[str, Any] | None, now: Scrape, before: Scrape | None = None
) -> dict[str, Any]:
    """Everything a frame shows, as plain values (the ``--once`` JSON line)."""
    lags: dict[str, dict[str, float | None]] = {}
    for label, histogram in LAGS:
        buckets = _delta(now.buckets(histogram), before.buckets(histogram) if before else None)
        count = max(buckets.values(), default=0.0)
        lags[label] = {
            "count": count,
            "p50_s": quantile(0.5, buckets),
            "p99_s": quantile(0.99, buckets),
        }
    return {
        "at": round(now.at, 3),
        "window": f"last {now.at - before.at:.0f}s" if before else "since the processes started",
        "database": database,
        "connections": {
            k: int(v) for k, v in now.by("aivedio_gateway_connections", "transport").items()
        },
        "queued_events": int(now.total("aivedio_gateway_queued_events")),
        "lags": lags,
        "counters": {label: now.total(name) for label, name in COUNTERS},
        "roles_down": now.down(),
        "metrics_unreachable": now.unreachable,
    }


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def render(data: dict[str, Any]) -> Group:
    """One frame: backlogs, tasks, reconciliation (PostgreSQL); connections, lags, counters
    (``/metrics``)."""
    parts: list[Any] = [Text(f"aivedio status  ({time.strftime('%H:%M:%S')})", style="bold")]
    database = data["database"]
    if database is None:
        error = data.get("database_error") or "unreachable"
        parts.append(Text(f"PostgreSQL: {error}", style="bold red"))
    else:
        parts.append(_database_tables(database))
    parts.append(_metrics_tables(data))
    if data["roles_down"]:
        parts.append(Text("roles down: " + ", ".join(data["roles_down"]), style="bold red"))
    if data["metrics_unreachable"]:
        parts.append(
            Text("metrics unreachable: " + ", ".join(data["metrics_unreachable"]), style="yellow")
        )
    return Group(*parts)


def _database_tables(database: dict[str, Any]) -> Columns:
    """Backlogs, in-flight tasks and open reconciliation items, from PostgreSQL."""
    backlog = Table(title="backlogs (PostgreSQL)", title_justify="left")
    backlog.add_column("queue")
    backlog.add_column("waiting", justify="right")
    backlog.add_column("dead", justify="right")
    backlog.add_row("callback inbox", str(database["inbox_pending"]), str(database["inbox_dead"]))
    backlog.add_row(
        f"outbox (oldest {database['outbox_oldest_s']:.1f} s)",
        str(database["outbox_pending"]),
        str(database["outbox_dead"]),
    )
    backlog.add_row("submit intents", str(database["submit_pending"]), "")
    backlog.add_row("cancel intents", str(database["cancel_pending"]), "")
    backlog.add_row("media operations", str(database["media_pending"]), "")
    tasks = Table(title="in-flight tasks", title_justify="left")
    tasks.add_column("status")
    tasks.add_column("tasks", justify="right")
    for status in IN_FLIGHT:
        tasks.add_row(status, str(database["tasks_in_flight"].get(status, 0)))
    recon = Table(title="open reconciliation items", title_justify="left")
    recon.add_column("kind")
    recon.add_column("items", justify="right")
    for kind, n in sorted(database["reconciliation_open"].items()) or [("(none)", 0)]:
        recon.add_row(kind, str(n))
    return Columns([backlog, tasks, recon])


def _metrics_tables(data: dict[str, Any]) -> Columns:
    """Connections, lags and counters, from the processes' ``/metrics``."""
    conns = Table(title="connections", title_justify="left")
    conns.add_column("transport")
    conns.add_column("open", justify="right")
    for transport in sorted(set(data["connections"]) | {"sse", "ws"}):
        conns.add_row(transport, str(data["connections"].get(transport, 0)))
    conns.add_row("queued events", str(data["queued_events"]))
    lags = Table(title=f"lags ({data['window']})", title_justify="left")
    lags.add_column("stage")
    lags.add_column("n", justify="right")
    lags.add_column("p50", justify="right")
    lags.add_column("p99", justify="right")
    for label, lag in data["lags"].items():
        lags.add_row(label, f"{lag['count']:.0f}", _seconds(lag["p50_s"]), _seconds(lag["p99_s"]))
    counters = Table(title="since the processes started", title_justify="left")
    counters.add_column("counter")
    counters.add_column("total", justify="right")
    for label, value in data["counters"].items():
        counters.add_row(label, f"{value:.0f}")
    return Columns([conns, lags, counters])


_DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError)


async def _database_figures(database_url: str) -> tuple[dict[str, Any] | None, str | None]:
    """The database's figures, or None and why not (unreachable, not migrated, ...)."""
    try:
        conn = await asyncpg.connect(database_url, timeout=5)
    except _DB_ERRORS as exc:
        return None, f"unreachable ({type(exc).__name__})"
    try:
        return await collect_database(conn), None
    except _DB_ERRORS as exc:
        return None, f"cannot be read ({type(exc).__name__}: {exc}; run aivedio migrate?)"
    finally:
        with contextlib.suppress(*_DB_ERRORS):
            await conn.close()


async def _frame(
    database_url: str, urls: Sequence[str], client: httpx.AsyncClient, before: Scrape | None
) -> tuple[dict[str, Any], Scrape]:
    (database, error), now = await asyncio.gather(
        _database_figures(database_url), scrape(urls, client)
    )
    data = figures(database, now, before)
    data["database_error"] = error
    return data, now


async def run_status(
    database_url: str,
    metrics_urls: Sequence[str],
    *,
    once: bool,
    interval_s: float = 2.0,
    console: Console | None = None,
) -> int:
    console = console or Console()
    async with httpx.AsyncClient(timeout=3.0, trust_env=False) as client:
        if once:
            data, _ = await _frame(database_url, metrics_urls, client, None)
            console.print(render(data))
            print(json.dumps(data, default=str), flush=True)
            return 0 if data["database"] is not None else 1
        before: Scrape | None = None
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                data, before = await _frame(database_url, metrics_urls, client, before)
                live.update(render(data))
                live.refresh()
                await asyncio.sleep(interval_s)
