"""The retention itself in ``aivedio bench retention``: the oldest day dropped while writers and
readers run, and one day of published outbox rows purged in batches."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from aivedio.bench.common import percentile, rounded
from aivedio.bench.retention_fill import _streams
from aivedio.bench.retention_options import Options, _ms
from aivedio.db.pool import Database
from aivedio.gateway.store import EventStore
from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import Maintenance, RoundResult, purge_batches

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


class _Load:
    """The writers, the readers and the lock watcher that run while the oldest day is dropped."""

    def __init__(
        self, db: Database, opts: Options, streams: list[tuple[uuid.UUID, int, int, int]]
    ) -> None:
        self.db, self.opts, self.streams = db, opts, streams
        self.stop = asyncio.Event()
        self.latencies: list[
            tuple[float, float]
        ] = []  # (start, seconds) of every writer transaction
        # (when, seconds) a writer's statement had waited for a lock, sampled
        self.lock_waits: list[tuple[float, float]] = []
        self.replays = 0

    def start(self) -> list[asyncio.Task[None]]:
        streams, opts = self.streams, self.opts
        jobs = [
            asyncio.create_task(self.writer(streams[i % len(streams)][0]))
            for i in range(opts.writers)
        ]
        jobs += [asyncio.create_task(self.reader()) for _ in range(opts.readers)]
        jobs.append(asyncio.create_task(self.watch_locks()))
        return jobs

    async def writer(self, project: uuid.UUID) -> None:
        task = uuid.uuid4()
        while not self.stop.is_set():
            began = time.perf_counter()
            async with self.db.connection() as conn:
                await conn.execute(_WRITE, project, task)
            self.latencies.append((began, time.perf_counter() - began))

    async def watch_locks(self) -> None:
        async with self.db.connection() as conn:
            while not self.stop.is_set():
                waited = await conn.fetchval(
                    """SELECT max(extract(epoch FROM clock_timestamp() - query_start))
                       FROM pg_stat_activity
                       WHERE wait_event_type = 'Lock'
                         AND query LIKE '/* bench retention writer */%'"""
                )
                if waited is not None:
                    self.lock_waits.append((time.perf_counter(), float(waited)))
                await asyncio.sleep(0.002)

    async def reader(self) -> None:
        store, rng = EventStore(self.db), random.Random(2)
        while not self.stop.is_set():
            project, epoch, _, floor = rng.choice(self.streams)
            await store.events(
                project, epoch, floor + 1, floor + 1 + self.opts.replay, self.opts.replay
            )
            self.replays += 1


async def _drop_under_load(db: Database, opts: Options, first_day: datetime) -> dict[str, Any]:
    streams = await _streams(db)
    async with db.connection() as conn:
        rows_in_day = await conn.fetchval(f'SELECT count(*) FROM "task_events_p{first_day:%Y%m%d}"')
    load = _Load(db, opts, streams)
    jobs = load.start()
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
        load.stop.set()
        await asyncio.gather(*jobs)
    return _drop_figures(opts, load, rows_in_day, result, drop_began, drop_s)


def _drop_figures(
    opts: Options,
    load: _Load,
    rows_in_day: int,
    result: RoundResult,
    drop_began: float,
    drop_s: float,
) -> dict[str, Any]:
    """The writers' latencies and lock waits before, during and after the drop, printed."""
    latencies, lock_waits, replays = load.latencies, load.lock_waits, load.replays
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
