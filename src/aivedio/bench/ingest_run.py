"""The run of ``aivedio bench ingest``: pgbench and the max-rate phase alternately, then the
half-rate phase, with the CPU per callback of each side."""

from __future__ import annotations

import contextlib
import os
import resource
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from aivedio.bench.common import database_url, percentile, scratch_database
from aivedio.bench.ingest_load import _run_clients
from aivedio.bench.ingest_options import PROVIDER, IngestOptions
from aivedio.bench.ingest_pgbench import _pgbench, _pgbench_seconds
from aivedio.bench.ingest_server import _servers
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database

# --- CPU per callback ----------------------------------------------------------------------------


def _cpu_s(pids: Sequence[int], command: bytes | None = None) -> float | None:
    """User + system CPU seconds of these processes so far (Linux ``/proc``); None when one
    cannot be read, or (``command``) is not that program: a remote PostgreSQL's backend pids
    mean nothing here."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if command is not None:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if command not in cmdline.read():
                        return None
        except OSError:
            return None
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


async def _backend_pids(conn_db: Database) -> list[int]:
    """The PostgreSQL backends of the servers' pools (this database's other client backends)."""
    async with conn_db.connection() as conn:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
    return [row["pid"] for row in rows]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _per_answer(before: float | None, after: float | None, answers: int) -> float | None:
    if before is None or after is None or answers == 0:
        return None
    return (after - before) / answers * 1e6


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Phase:
    per_s: float
    ok: int
    statuses: dict[str, int]
    p50_ms: float
    p95_ms: float
    p99_ms: float
    cpu_us: dict[str, float | None] = field(default_factory=dict)
    """CPU per answered request over the phase (warm-up included): ``servers``, ``clients``,
    ``postgres`` (the servers' backends; None when PostgreSQL is not on this machine)."""


def _phase(result: Mapping[str, Any], cpu_us: dict[str, float | None] | None = None) -> Phase:
    ms = [x * 1000 for x in result["latencies"]]
    return Phase(
        cpu_us=cpu_us or {},
        per_s=len(ms) / result["window"],
        ok=len(ms),
        statuses={str(k): v for k, v in result["statuses"].items()},
        p50_ms=percentile(ms, 50),
        p95_ms=percentile(ms, 95),
        p99_ms=percentile(ms, 99),
    )


async def _stored_then_empty(conn_db: Database) -> int:
    """Our committed rows (pgbench's have their own provider); every phase then starts on an
    empty table right after a checkpoint, pgbench's and ours alike (a run writes ~200 MB of WAL:
    a checkpoint forced by max_wal_size fell in one phase or another, and cost that phase up to
    15 %)."""
    async with conn_db.connection() as conn:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM provider_callback_inbox WHERE provider = $1", PROVIDER
        )
        await conn.execute("TRUNCATE provider_callback_inbox")
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CHECKPOINT")  # superuser or pg_checkpoint only
    return count


async def _closed_phase(
    conn_db: Database, opts: IngestOptions, common: dict[str, Any], run_id: str, servers: list[int]
) -> Phase:
    """One max-rate run, with the CPU per answered callback of each side."""
    backends = await _backend_pids(conn_db)
    before = (_cpu_s(servers), _cpu_s(backends, b"postgres"))
    closed = {"mode": "closed", "warmup": opts.warmup, "run_id": run_id}
    result = await _run_clients(opts.client_processes, common | closed)
    after = (_cpu_s(servers), _cpu_s(backends, b"postgres"))
    answers = sum(result["statuses"].values())
    return _phase(
        result,
        {
            "servers": _per_answer(before[0], after[0], answers),
            "clients": _per_answer(0.0, result["cpu_s"], answers),
            "postgres": _per_answer(before[1], after[1], answers),
        },
    )


async def _pgbench_run(url: str, clients: int, seconds: float) -> tuple[float, float]:
    """One pgbench run: its TPS, and its own CPU per transaction (us)."""
    cpu = _children_cpu_s()  # pgbench is the only child reaped meanwhile
    tps = await _pgbench(url, clients, seconds)
    transactions = tps * _pgbench_seconds(seconds)
    return tps, (_children_cpu_s() - cpu) / transactions * 1e6


async def _main(settings: Settings, opts: IngestOptions) -> dict[str, Any]:
    clients = [int(c) for c in opts.pgbench_clients.split(",") if c.strip()]
    async with scratch_database(database_url(settings), "aivedio_bench_ingest") as url:
        conn_db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=1))
        pgbench: dict[int, list[float]] = {c: [] for c in clients}
        pgbench_cpu: list[float] = []  # pgbench's own CPU per transaction
        tops: list[Phase] = []
        stored = 0
        run_id = uuid.uuid4().hex[:8]
        try:
            async with _servers(url, opts) as (port, servers):
                common = {"port": port, "connections": opts.connections, "seconds": opts.seconds}
                # Alternated, so a slow spell of the machine hits both sides alike.
                for r in range(opts.repeats):
                    for c in clients:
                        stored += await _stored_then_empty(conn_db)
                        tps, cpu_us = await _pgbench_run(url, c, opts.seconds)
                        pgbench[c].append(tps)
                        pgbench_cpu.append(cpu_us)
                    stored += await _stored_then_empty(conn_db)
                    tops.append(
                        await _closed_phase(conn_db, opts, common, f"{run_id}a{r}", servers)
                    )
                top = max(tops, key=lambda phase: phase.per_s)
                stored += await _stored_then_empty(conn_db)
                half = _phase(
                    await _run_clients(
                        opts.client_processes,
                        common | {"mode": "open", "rate": top.per_s / 2, "run_id": run_id + "b"},
                    )
                )
            stored += await _stored_then_empty(conn_db)
        finally:
            await conn_db.close()
    # Every 204 of every phase (warm-ups included) must have its committed row.
    accepted = sum(phase.statuses.get("204", 0) for phase in (*tops, half))
    return {
        "pgbench": {c: max(runs) for c, runs in pgbench.items()},
        "pgbench_runs": pgbench,
        "pgbench_client_cpu_us": min(pgbench_cpu),
        "ceiling": max(max(runs) for runs in pgbench.values()),
        "top": top,
        "top_runs": [phase.per_s for phase in tops],
        "half": half,
        "stored": stored,
        "accepted": accepted,
    }
