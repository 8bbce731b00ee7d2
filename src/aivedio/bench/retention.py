"""``aivedio bench retention``: months of events, then what retention and replay cost.

A scratch database is filled with ``events`` task events over ``days`` day partitions (default 10
million over 30 days, ``projects`` streams; ``events=200000`` for CI), then it prints:

- bytes per event (the partitions of task_events with their indexes, after VACUUM ANALYZE), as
  written and once the closed days' indexes were packed (what the maintenance role does);
- the time of a replay of ``replay`` events (1,000) from a cursor, through the gateway's own
  query (``EventStore.events``): p50/p99 at the head and deep in history (the oldest tenth);
- ``EXPLAIN (ANALYZE, BUFFERS)`` of the replay, the task snapshot and the inbox and outbox claims;
- the time to drop the oldest day (a maintenance round: floors raised, DETACH ... CONCURRENTLY,
  DROP) while ``writers`` concurrent writers commit events (each its own stream, as the state
  service does: stream row + event + outbox row in one statement) and ``readers`` replay: the
  longest writer transaction during the drop against the longest before it (the same load);
- the cost of deleting one day of published outbox rows in batches (the outbox's retention),
  beside the partition drop of one day of events.

The JSON line last carries ``bytes_per_event``, ``replay_p99_ms``, ``drop_partition_ms`` and
``max_writer_block_ms`` (and the rest by name).
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    database_url,
    percentile,
    print_json_line,
    rounded,
    scratch_database,
)
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.gateway.store import EVENTS, EventStore
from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import Maintenance, purge_batches
from aivedio.retention.partitions import compact, compactable, list_partitions


@dataclass(frozen=True, slots=True)
class Options:
    events: int = 10_000_000
    days: int = 30
    projects: int = 100
    tasks: int = 100_000  # rows of generation_tasks (the snapshot's table)
    replay: int = 1000  # events per replay
    samples: int = 200  # replays measured at the head, and as many deep
    writers: int = 4
    readers: int = 2
    probe_s: float = 3.0  # the writers' load before the drop (the baseline), and after it
    outbox_rows: int = 0  # published outbox rows to purge; 0: one day of events
    inbox_rows: int = 10_000  # processed inbox rows (the claim's EXPLAIN), 100 of them pending

    def check(self) -> None:
        if self.days < 2:
            raise BenchUsageError("days must be at least 2 (one is dropped, one is written)")
        if self.events < self.days * self.projects or self.projects < 1:
            raise BenchUsageError("events must give every project at least one event a day")
        if self.writers < 1 or self.samples < 1 or self.replay < 1:
            raise BenchUsageError("writers, samples and replay must be at least 1")


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


def _ms(seconds: float) -> float:
    return seconds * 1000.0


async def _run(settings: Settings, opts: Options) -> int:
    async with scratch_database(database_url(settings), "aivedio_bench_retention") as url:
        db = await Database.connect(
            DatabaseConfig(
                url=url,
                min_size=2,
                max_size=opts.writers + opts.readers + 4,
                command_timeout_s=600.0,
            )
        )
        try:
            figures = await _measure(db, opts)
        finally:
            await db.close()
    print_json_line({"bench": "retention", **figures})
    return 0


async def _measure(db: Database, opts: Options) -> dict[str, Any]:
    per_day = opts.events // (opts.projects * opts.days)  # events per project per day
    total = per_day * opts.projects * opts.days
    print(f"filling {total:,} events: {opts.projects} projects x {opts.days} days x {per_day}")
    began = time.perf_counter()
    first_day = await _fill(db, opts, per_day)
    fill_s = time.perf_counter() - began
    print(f"  filled in {fill_s:.1f} s ({total / fill_s:,.0f} events/s)")

    async with db.connection() as conn:
        await conn.execute("VACUUM ANALYZE task_events")
        await conn.execute("VACUUM ANALYZE generation_tasks")
        await conn.execute("VACUUM ANALYZE provider_callback_inbox")
    heap, indexes, stored = await _sizes(db, "as written")
    unpacked = (heap + indexes) / stored
    began = time.perf_counter()
    conn = await db.session()
    try:
        closed = await compactable(conn, await list_partitions(conn), datetime.now(UTC))
        for partition in closed:
            await compact(conn, partition)
    finally:
        await conn.close()
    compact_s = time.perf_counter() - began
    print(f"  {len(closed)} closed days packed (REINDEX CONCURRENTLY) in {compact_s:.1f} s")
    heap, indexes, stored = await _sizes(db, "closed days packed")
    bytes_per_event = (heap + indexes) / stored

    streams = await _streams(db)
    # As the gateway's server does at start (gateway/server.py): what exists now (the fill's
    # objects here, the app's there) is never scanned again by the cyclic GC, whose full
    # collections were the replays' p99 (60 ms against 14 ms with it, bench at 200,000).
    gc.collect()
    gc.freeze()
    head_ms, deep_ms = await _replays(db, opts, streams)
    sql_head_ms, sql_deep_ms = await _replays(db, opts, streams, raw=True)
    for where, values, sql in (("head", head_ms, sql_head_ms), ("deep", deep_ms, sql_deep_ms)):
        print(
            f"replay {opts.replay} events {where}: p50 {percentile(values, 50):.2f} ms, "
            f"p99 {percentile(values, 99):.2f} ms ({len(values)} replays, decoded into frames);"
            f" the query alone p50 {percentile(sql, 50):.2f} ms, p99 {percentile(sql, 99):.2f} ms"
        )
    await _explain(db, opts, streams)

    drop = await _drop_under_load(db, opts, first_day)
    outbox = await _outbox_purge(db, opts.outbox_rows or per_day * opts.projects)
    replay_p99 = max(percentile(head_ms, 99), percentile(deep_ms, 99))
    return {
        "events": stored,
        "days": opts.days,
        "projects": opts.projects,
        "fill_s": rounded(fill_s, 1),
        "bytes_per_event": rounded(bytes_per_event, 1),
        "bytes_per_event_unpacked": rounded(unpacked, 1),
        "heap_bytes": heap,
        "index_bytes": indexes,
        "compact_s": rounded(compact_s, 2),
        "replay_events": opts.replay,
        "replay_head_p50_ms": rounded(percentile(head_ms, 50)),
        "replay_head_p99_ms": rounded(percentile(head_ms, 99)),
        "replay_deep_p50_ms": rounded(percentile(deep_ms, 50)),
        "replay_deep_p99_ms": rounded(percentile(deep_ms, 99)),
        "replay_p99_ms": rounded(replay_p99),
        "replay_sql_head_p99_ms": rounded(percentile(sql_head_ms, 99)),
        "replay_sql_deep_p99_ms": rounded(percentile(sql_deep_ms, 99)),
        **drop,
        **outbox,
        "options": asdict(opts),
    }


async def _sizes(db: Database, label: str) -> tuple[int, int, int]:
    """Heap (with TOAST) and index bytes of every partition of task_events, and its rows."""
    async with db.connection() as conn:
        row = await conn.fetchrow(
            """SELECT sum(pg_table_size(inhrelid))::bigint AS heap,
                      sum(pg_indexes_size(inhrelid))::bigint AS indexes,
                      count(*) AS partitions
               FROM pg_inherits WHERE inhparent = 'task_events'::regclass"""
        )
        stored: int = await conn.fetchval("SELECT count(*) FROM task_events")
    assert row is not None
    heap, indexes = int(row["heap"]), int(row["indexes"])
    print(
        f"task_events ({label}): {stored:,} events in {row['partitions']} partitions; heap "
        f"{heap / 2**20:,.1f} MiB + indexes {indexes / 2**20:,.1f} MiB = "
        f"{(heap + indexes) / stored:.0f} bytes/event ({heap / stored:.0f} + "
        f"{indexes / stored:.0f})"
    )
    return heap, indexes, stored


# -- the fill ------------------------------------------------------------------------------

_FILL_DAY = """
INSERT INTO task_events (project_id, epoch, seq, task_id, task_version, public_payload, source,
                         trace_id, created_at)
SELECT p.project_id, p.epoch, n.seq, n.task_id, n.version,
       -- as write_event stores it (state.events.stored_payload): compact, no identity fields
       format('{"status":"running","stage":"generating","progress":%s}', n.seq % 100)::json,
       -- a traceparent's 16 bytes (aivedio's own ids have 12)
       'webhook', decode(md5(n.seq::text || p.project_id::text), 'hex'), n.at
FROM generate_series(1, $2::int) AS k
CROSS JOIN bench_streams p
CROSS JOIN LATERAL (
    SELECT $1::int * $2::int + k AS seq,
           md5(p.project_id::text || (($1::int * $2::int + k - 1) / 5))::uuid AS task_id,
           (($1::int * $2::int + k - 1) % 5) + 1 AS version,
           $3::timestamptz + (k - 0.5) * ($4::float8 / $2::int) * interval '1 second' AS at
) AS n
"""


async def _fill(db: Database, opts: Options, per_day: int) -> datetime:
    """Projects, streams, tasks, the old days' partitions, the events; the first day."""
    today = datetime.now(UTC).date()
    first = today - timedelta(days=opts.days - 1)
    epoch = int(time.time() * 1000)
    async with db.connection() as conn:
        await conn.execute("INSERT INTO tenants (id, name) VALUES ($1, 'bench')", uuid.uuid4())
        tenant = await conn.fetchval("SELECT id FROM tenants")
        await conn.execute(
            """INSERT INTO projects (id, tenant_id, name)
               SELECT gen_random_uuid(), $1, 'p' || n FROM generate_series(1, $2) n""",
            tenant,
            opts.projects,
        )
        await conn.execute(
            "INSERT INTO event_streams (project_id, epoch, head) SELECT id, $1, $2 FROM projects",
            epoch,
            per_day * opts.days,
        )
        await conn.execute(
            """CREATE UNLOGGED TABLE bench_streams AS
               SELECT s.project_id, s.epoch, p.tenant_id FROM event_streams s
               JOIN projects p ON p.id = s.project_id"""
        )
        await conn.execute(
            """INSERT INTO generation_tasks (id, tenant_id, project_id, user_id, provider, model,
                   prompt, status, stage, version, last_event_id, created_at, updated_at)
               SELECT md5(p.project_id::text || n)::uuid, p.tenant_id, p.project_id,
                      p.tenant_id, 'sandbox', 'm', 'a cat', 'running', 'generating', 5, n * 5,
                      now(), now()
               FROM bench_streams p, generate_series(0, $1::int / $2::int) n""",
            opts.tasks,
            opts.projects,
        )
        for offset in range(opts.days):
            day = first + timedelta(days=offset)
            low = datetime(day.year, day.month, day.day, tzinfo=UTC)
            name = f"task_events_p{day:%Y%m%d}"
            if await conn.fetchval("SELECT to_regclass($1)", name) is None:
                await conn.execute(f'CREATE TABLE "{name}" (LIKE task_events INCLUDING DEFAULTS)')
                await conn.execute(
                    f'ALTER TABLE task_events ATTACH PARTITION "{name}" FOR VALUES FROM '
                    f"('{low.isoformat()}') TO ('{(low + timedelta(days=1)).isoformat()}')"
                )
            await conn.execute(_FILL_DAY, offset, per_day, low, 86400.0 * 0.99)
        await conn.execute(
            """INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash,
                   process_status, payload, processed_at, received_at)
               SELECT 'sandbox', 'k' || n, '\\x00'::bytea,
                      CASE WHEN n % 100 = 0 THEN 'pending' ELSE 'processed' END,
                      '{}'::jsonb, now(), now() - interval '1 hour'
               FROM generate_series(1, $1) n""",
            opts.inbox_rows,
        )
    return datetime(first.year, first.month, first.day, tzinfo=UTC)


async def _streams(db: Database) -> list[tuple[uuid.UUID, int, int, int]]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT project_id, epoch, head, floor FROM event_streams")
    return [(r["project_id"], r["epoch"], r["head"], r["floor"]) for r in rows]


# -- replays -------------------------------------------------------------------------------


_EVENTS_RAW = EVENTS  # the payload comes as text: the rows, not decoded


async def _replays(
    db: Database,
    opts: Options,
    streams: list[tuple[uuid.UUID, int, int, int]],
    raw: bool = False,
) -> tuple[list[float], list[float]]:
    """Replay times at the head and deep: through ``EventStore.events`` (rows decoded, frames
    built: what the gateway does), or with ``raw`` the same query's rows only (PostgreSQL and
    the wire, the payload left as text)."""
    store = EventStore(db)
    rng = random.Random(1)
    head_ms: list[float] = []
    deep_ms: list[float] = []
    # Warm every pooled connection first: its first replay prepares the statement (planning
    # over every partition, type introspection), as a gateway's connection does once.
    project, epoch, head, floor = streams[0]
    await asyncio.gather(
        *(
            store.events(project, epoch, floor, head, opts.replay)
            for _ in range(db.pool.get_max_size())
        )
    )
    for _ in range(opts.samples):
        for where, out in (("head", head_ms), ("deep", deep_ms)):
            project, epoch, head, floor = rng.choice(streams)
            if where == "head":
                after = max(floor, head - opts.replay)
            else:
                after = floor + rng.randrange(max(1, (head - floor) // 10))
            began = time.perf_counter()
            if raw:
                async with db.connection() as conn:
                    rows = await conn.fetch(_EVENTS_RAW, project, epoch, after, head, opts.replay)
                first = rows[0]["seq"] if rows else None
            else:
                events = await store.events(project, epoch, after, head, opts.replay)
                first = events[0].seq if events else None
            out.append(_ms(time.perf_counter() - began))
            assert first == after + 1, (project, after, first)
    return head_ms, deep_ms


async def _explain(
    db: Database, opts: Options, streams: list[tuple[uuid.UUID, int, int, int]]
) -> None:
    project, epoch, _, floor = streams[0]
    async with db.connection() as conn:
        task = await conn.fetchval(
            "SELECT id FROM generation_tasks WHERE project_id = $1 LIMIT 1", project
        )
        await conn.execute(
            """INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version,
                   event_type, payload)
               SELECT 'task', gen_random_uuid(), 1, 'task.status.changed', '{}'::jsonb
               FROM generate_series(1, 100)"""
        )
        await conn.execute("ANALYZE outbox_events")
        plans = {
            "replay (deep, the gateway's query)": (
                EVENTS,
                (project, epoch, floor + 10, floor + 10 + opts.replay, opts.replay),
            ),
            "snapshot (task_snapshot)": (q("task_snapshot"), (task, project)),
            "inbox claim (inbox_claim)": (q("inbox_claim"), (100, 60.0, uuid.uuid4())),
            "outbox claim (outbox_claim)": (q("outbox_claim"), (100,)),
        }
        for title, (sql, args) in plans.items():
            tx = conn.transaction()
            await tx.start()
            try:
                rows = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", *args)
            finally:
                await tx.rollback()  # the claims lock and update rows: leave nothing behind
            print(f"EXPLAIN (ANALYZE, BUFFERS) {title}:")
            for row in rows:
                print("    " + row[0])


# -- the drop under load -------------------------------------------------------------------

_WRITE = """
/* bench retention writer */
WITH stream AS (
    UPDATE event_streams SET head = head + 1, updated_at = now()
    WHERE project_id = $1
    RETURNING project_id, epoch, head
), event AS (
    INSERT INTO task_events (project_id, epoch, seq, task_id, task_version, public_payload,
                             source, trace_id, created_at)
    SELECT project_id, epoch, head, $2, head,
           '{"status":"running","stage":"generating","progress":50}'::json,
           'webhook', decode(md5(head::text), 'hex'), clock_timestamp()
    FROM stream
)
INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'task', $2, head, 'task.status.changed', '{}'::jsonb FROM stream
"""


async def _drop_under_load(db: Database, opts: Options, first_day: datetime) -> dict[str, Any]:
    streams = await _streams(db)
    async with db.connection() as conn:
        rows_in_day = await conn.fetchval(f'SELECT count(*) FROM "task_events_p{first_day:%Y%m%d}"')
    stop = asyncio.Event()
    latencies: list[tuple[float, float]] = []  # (start, seconds) of every writer transaction
    replays = 0

    async def writer(project: uuid.UUID) -> None:
        task = uuid.uuid4()
        while not stop.is_set():
            began = time.perf_counter()
            async with db.connection() as conn:
                await conn.execute(_WRITE, project, task)
            latencies.append((began, time.perf_counter() - began))

    lock_waits: list[
        tuple[float, float]
    ] = []  # (when, seconds) a writer's statement had waited for a lock, sampled

    async def watch_locks() -> None:
        async with db.connection() as conn:
            while not stop.is_set():
                waited = await conn.fetchval(
                    """SELECT max(extract(epoch FROM clock_timestamp() - query_start))
                       FROM pg_stat_activity
                       WHERE wait_event_type = 'Lock'
                         AND query LIKE '/* bench retention writer */%'"""
                )
                if waited is not None:
                    lock_waits.append((time.perf_counter(), float(waited)))
                await asyncio.sleep(0.002)

    async def reader() -> None:
        nonlocal replays
        store, rng = EventStore(db), random.Random(2)
        while not stop.is_set():
            project, epoch, _, floor = rng.choice(streams)
            await store.events(project, epoch, floor + 1, floor + 1 + opts.replay, opts.replay)
            replays += 1

    jobs = [asyncio.create_task(writer(streams[i % len(streams)][0])) for i in range(opts.writers)]
    jobs += [asyncio.create_task(reader()) for _ in range(opts.readers)]
    jobs.append(asyncio.create_task(watch_locks()))
    try:
        await asyncio.sleep(opts.probe_s)
        drop_began = time.perf_counter()
        # The oldest day is just past the retention: exactly one partition goes.
        clock = first_day + timedelta(days=1) + RetentionConfig().event_retention
        config = RetentionConfig(compact=False)  # the packing is measured on its own (above)
        result = await Maintenance(db, config, clock=lambda: clock).run_once()
        drop_s = time.perf_counter() - drop_began
        await asyncio.sleep(opts.probe_s)
    finally:
        stop.set()
        await asyncio.gather(*jobs)
    before = [s for at, s in latencies if at + s < drop_began]
    during = [s for at, s in latencies if at + s >= drop_began and at <= drop_began + drop_s]
    after = [s for at, s in latencies if at > drop_began + drop_s]
    base_max = max(before, default=float("nan"))
    slowest = max(during, default=0.0)
    # A writer blocked by the drop waits for a lock: the longest such wait seen (sampled every
    # few ms) is the figure; the writers' latencies are the context (noisy on a shared machine).
    block = max((w for at, w in lock_waits if at >= drop_began), default=0.0)
    base_block = max((w for at, w in lock_waits if at < drop_began), default=0.0)
    print(
        f"drop of the oldest day ({rows_in_day:,} events; {result.partitions_dropped}, "
        f"{result.floors_raised} floors raised): {_ms(drop_s):.1f} ms, with {opts.writers} "
        f"writers and {opts.readers} readers ({replays} replays) running"
    )
    print(
        f"  longest lock wait of a writer: {_ms(block):.2f} ms from the drop on "
        f"({_ms(base_block):.2f} ms before it; {len(lock_waits)} waits sampled)"
    )
    print(
        f"  writer transactions: before the drop p99 {_ms(percentile(before, 99)):.2f} ms, max "
        f"{_ms(base_max):.2f} ms ({len(before)}); during it max {_ms(slowest):.2f} ms "
        f"({len(during)}); after it p99 {_ms(percentile(after, 99)):.2f} ms ({len(after)})"
    )
    return {
        "drop_partition_ms": rounded(_ms(drop_s), 1),
        "drop_partition_events": rows_in_day,
        "floors_raised": result.floors_raised,
        "max_writer_block_ms": rounded(_ms(block), 2),
        "max_writer_block_ms_before_drop": rounded(_ms(base_block), 2),
        "writer_max_ms_during_drop": rounded(_ms(slowest), 2),
        "writer_max_ms_before_drop": rounded(_ms(base_max), 2),
        "writer_p99_ms_before_drop": rounded(_ms(percentile(before, 99)), 2),
        "writes_during_drop": len(during),
    }


async def _outbox_purge(db: Database, rows: int) -> dict[str, Any]:
    """One day of published outbox rows, deleted in batches as the maintenance role does."""
    async with db.connection() as conn:
        # Rows of the phases before (pending, young) would stop the walk at once: ids follow
        # time in a real outbox, so the old published rows come first.
        await conn.execute("TRUNCATE outbox_events")
        await conn.execute(
            """INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version,
                   event_type, payload, publish_status, created_at, published_at)
               SELECT 'task', gen_random_uuid(), 1, 'task.status.changed',
                      '{"status": "running", "stage": "generating"}'::jsonb, 'published',
                      now() - interval '2 days', now() - interval '2 days'
               FROM generate_series(1, $1)""",
            rows,
        )
        await conn.execute("VACUUM ANALYZE outbox_events")
        began = time.perf_counter()
        deleted = await purge_batches(
            conn, "purge_outbox_batch", datetime.now(UTC) - timedelta(days=1), 1000
        )
        purge_s = time.perf_counter() - began
    print(
        f"outbox: {deleted:,} published rows deleted in batches of 1,000 in {_ms(purge_s):.1f} ms"
        f" ({_ms(purge_s) / max(1, deleted) * 1000:.2f} ms per 1,000 rows)"
    )
    return {
        "outbox_purge_rows": deleted,
        "outbox_purge_ms": rounded(_ms(purge_s), 1),
        "outbox_purge_ms_per_1000": rounded(_ms(purge_s) / max(1, deleted) * 1000, 3),
    }


__all__ = ["Options", "run"]
