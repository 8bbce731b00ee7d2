"""Helpers for the retention tests: age events into an old day's partition, check floors."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from aivedio.db.pool import Database


async def age_events(db: Database, project_id: uuid.UUID, upto_seq: int, days: int) -> str:
    """Move the project's events with seq <= ``upto_seq`` to a day ``days`` ago (a partition of
    that day is made if missing, as the maintenance role made them then); the partition."""
    day = (datetime.now(UTC) - timedelta(days=days)).date()
    name = f"task_events_p{day:%Y%m%d}"
    low = datetime(day.year, day.month, day.day, tzinfo=UTC)
    async with db.connection() as conn:
        if await conn.fetchval("SELECT to_regclass($1)", name) is None:
            await conn.execute(f'CREATE TABLE "{name}" (LIKE task_events INCLUDING DEFAULTS)')
            await conn.execute(
                f"ALTER TABLE task_events ATTACH PARTITION \"{name}\" FOR VALUES FROM ('{low}') "
                f"TO ('{low + timedelta(days=1)}')"
            )
        await conn.execute(
            "UPDATE task_events SET created_at = $3::timestamptz"
            " + (created_at - date_trunc('day', created_at))"
            " WHERE project_id = $1 AND seq <= $2",
            project_id,
            upto_seq,
            low,
        )
    return name


async def holes_above_floor(db: Database) -> dict[uuid.UUID, list[int]]:
    """Per stream, the seqs in (floor, head] of its epoch that are not stored (none expected,
    ever: a cursor at or above the floor must replay completely)."""
    async with db.connection() as conn:
        rows = await conn.fetch(
            """SELECT s.project_id, array_agg(g.seq ORDER BY g.seq) AS missing
               FROM event_streams s
               CROSS JOIN LATERAL generate_series(s.floor + 1, s.head) AS g(seq)
               WHERE NOT EXISTS (SELECT 1 FROM task_events e WHERE e.project_id = s.project_id
                                 AND e.epoch = s.epoch AND e.seq = g.seq)
               GROUP BY s.project_id"""
        )
    return {r["project_id"]: list(r["missing"]) for r in rows}


async def stream_row(db: Database, project_id: uuid.UUID) -> tuple[int, int, int]:
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT epoch, head, floor FROM event_streams WHERE project_id = $1", project_id
        )
    return row["epoch"], row["head"], row["floor"]
