"""The replays of ``aivedio bench retention``: at the head and deep in history, through the
gateway's query, and the EXPLAIN of the replay, the snapshot and the claims."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

from aivedio.bench.retention_options import Options, _ms
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.gateway.store import EVENTS, EventStore

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
