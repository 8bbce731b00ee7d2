"""The fill of ``aivedio bench retention``: projects, streams, tasks, day partitions and months of
events written with SQL; and the bytes they take."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

from aivedio.bench.retention_options import Options
from aivedio.db.pool import Database


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
