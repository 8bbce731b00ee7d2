"""Phase (b) of ``aivedio bench propagation``: commit -> Redis subscriber latency under a steady
rate, and of single events one at a time."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import asyncpg

from aivedio.admin import create_project_in
from aivedio.bench.common import percentile, rounded
from aivedio.bench.propagation_options import Options
from aivedio.bench.propagation_pipeline import _cpu_line, _pipeline, _specs
from aivedio.bench.propagation_subscriber import Counted
from aivedio.bench.propagation_writers import _writers
from aivedio.bus import BusConfig
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore

# -- (b) latency -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Measured:
    """What the latency phase measured, before the figures are worked out."""

    acked: dict[tuple[str, int], tuple[float, float]]  # (COMMIT sent, returned)
    cpu: dict[str, float]
    single: list[float]
    given: int
    lag: list[float]
    seconds: float
    picked: list[asyncpg.Record]


async def _latency(
    settings: Settings,
    url: str,
    bus: BusConfig,
    redis_url: str,
    prefix: str,
    opts: Options,
    counted: Counted,
) -> dict[str, Any]:
    if opts.rate == 0 or opts.seconds == 0:
        return {}
    measured = await _measure(settings, url, bus, redis_url, prefix, opts, counted)
    return _figures(opts, counted, measured)


async def _measure(
    settings: Settings,
    url: str,
    bus: BusConfig,
    redis_url: str,
    prefix: str,
    opts: Options,
    counted: Counted,
) -> _Measured:
    """The steady load (after the probe) with the pipeline running, and the relay rounds' start."""
    db = await Database.connect(
        DatabaseConfig(url=url, min_size=4, max_size=min(16, opts.workers), acquire_timeout_s=30)
    )
    try:
        state = StateService(db, settings.state)
        attempts = await _make_tasks(db, state, opts)
        acked: dict[tuple[str, int], tuple[float, float]] = {}  # (COMMIT sent, returned)
        cpu: dict[str, float] = {}
        async with _pipeline(
            _specs(url, bus, redis_url, prefix, replace(opts, relays=opts.latency_relays)), cpu
        ):
            await asyncio.sleep(1.0)  # the creations' events drain first
            single = await _probe(url, counted, opts.probe)
            given, lag, seconds = await _writers(url, settings, attempts, opts, acked, cpu)
            deadline = time.perf_counter() + 10
            while not set(acked) <= set(counted.first) and time.perf_counter() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # Where the time goes: the relay round that published the event started at
        # published_at (its transaction's now(); this machine's clock, like the stamps).
        async with db.connection() as conn:
            picked = await conn.fetch(
                "SELECT aggregate_id::text AS task_id, aggregate_version AS task_version,"
                " extract(epoch FROM published_at)::float8 AS at"
                " FROM outbox_events WHERE published_at IS NOT NULL"
            )
    finally:
        await db.close()
    return _Measured(acked, cpu, single, given, lag, seconds, picked)


def _figures(opts: Options, counted: Counted, measured: _Measured) -> dict[str, Any]:
    """The latency figures printed, and returned for the JSON line."""
    acked, cpu, single = measured.acked, measured.cpu, measured.single
    given, lag, seconds, picked = measured.given, measured.lag, measured.seconds, measured.picked
    received = [(k, sent, done) for k, (sent, done) in acked.items() if k in counted.first]
    latencies = [(counted.first[k] - done) * 1000 for k, _, done in received]
    upper = [(counted.first[k] - sent) * 1000 for k, sent, _ in received]
    flush = [(done - sent) * 1000 for _, sent, done in received]
    lost = len(acked) - len(received)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(
        f"  latency: commit (COMMIT returned in the writer) -> Redis subscriber "
        f"p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {max(latencies, default=0):.2f} ms  "
        f"({len(acked)} events at {len(acked) / seconds:,.0f}/s asked {opts.rate}/s by "
        f"{opts.writers} writer processes, {given} observations, {lost} not received; writers' "
        f"scheduler lag p99 {percentile(lag, 99):.1f} ms)",
        flush=True,
    )
    round_start = {(r["task_id"], r["task_version"]): r["at"] for r in picked}
    to_round = [(round_start[k] - done) * 1000 for k, _, done in received if k in round_start]
    print(
        f"  upper bound, from COMMIT sent: p50 {percentile(upper, 50):.2f} ms  "
        f"p99 {percentile(upper, 99):.2f} ms (the writer's COMMIT itself took p50 "
        f"{percentile(flush, 50):.2f} ms  p99 {percentile(flush, 99):.2f} ms); where: commit -> "
        f"start of the relay round that published it p50 {percentile(to_round, 50):.2f} ms  "
        f"p99 {percentile(to_round, 99):.2f} ms",
        flush=True,
    )
    if single:
        print(
            f"  single events (one at a time, every 20 ms): commit -> Redis subscriber "
            f"p50 {percentile(single, 50):.2f} ms  p90 {percentile(single, 90):.2f} ms  "
            f"p99 {percentile(single, 99):.2f} ms",
            flush=True,
        )
    print(f"  latency CPU (whole phase): {_cpu_line(cpu, len(acked))}", flush=True)
    return {
        "p50_ms": rounded(p50),
        "p99_ms": rounded(p99),
        "p50_ms_upper": rounded(percentile(upper, 50)),
        "p99_ms_upper": rounded(percentile(upper, 99)),
        "latency_events": len(acked),
        "latency_rate_per_s": rounded(len(acked) / seconds, 1),
        "latency_missing": lost,
        "latency_writers": opts.writers,
        "single_p50_ms": rounded(percentile(single, 50)) if single else None,
        "single_p99_ms": rounded(percentile(single, 99)) if single else None,
        "latency_cpu_us_per_event": {
            k: rounded(v / max(len(acked), 1) * 1e6, 1) for k, v in cpu.items()
        },
    }


ONE = """
INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
VALUES ('task', $1, $2::int, 'task.status.changed', jsonb_build_object(
    'event_type', 'task.status.changed', 'aggregate_id', $1::uuid, 'aggregate_version', $2::int,
    'project_id', $1::uuid, 'epoch', 1, 'event_id', $2::int, 'status', 'running',
    'public', jsonb_build_object('task_id', $1::uuid, 'task_version', $2::int,
                                 'status', 'generating', 'progress', $2::int)))
"""


async def _probe(url: str, counted: Counted, n: int) -> list[float]:
    """The path's own latency: ``n`` outbox rows committed one at a time (20 ms apart), each
    timed from its COMMIT returning in this otherwise idle process to the subscriber."""
    if n <= 0:
        return []
    conn = await asyncpg.connect(url)
    out: list[float] = []
    try:
        task = uuid.uuid4()
        for version in range(1, n + 1):
            await conn.execute(ONE, task, version)
            committed = time.time()
            key = (str(task), version)
            deadline = committed + 5
            while key not in counted.first and time.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.0002)
            if key in counted.first:
                out.append((counted.first[key] - committed) * 1000)
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
    return out


async def _make_tasks(db: Database, state: StateService, opts: Options) -> list[uuid.UUID]:
    principals = []
    async with db.connection() as conn:
        for i in range(opts.projects):
            made = await create_project_in(conn, "bench", f"prop-{i}")
            principal = Principal(uuid.UUID(made["tenant_id"]), uuid.UUID(made["user_id"]))
            principals.append((uuid.UUID(made["project_id"]), principal))
    store = TaskStore(db, state, timedelta(hours=1))
    body = NewTask(provider="sandbox", model="bench", prompt="a cat on a skateboard", params={})
    sem = asyncio.Semaphore(opts.workers)

    async def create(i: int) -> uuid.UUID:
        project_id, principal = principals[i % len(principals)]
        async with sem:
            created = await store.create(principal, project_id, uuid.uuid4().hex, body, None)
        async with db.connection() as conn:
            attempt: uuid.UUID = await conn.fetchval(
                "SELECT current_attempt_id FROM generation_tasks WHERE id = $1",
                uuid.UUID(created.snapshot["id"]),
            )
        return attempt

    return list(await asyncio.gather(*(create(i) for i in range(opts.latency_tasks))))
