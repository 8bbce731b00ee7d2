"""Migration 0012 converts a populated database: no row lost, no seq, epoch or cursor changed;
the old rows are one partition that retention drops like any other."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from aivedio.config import DatabaseConfig
from aivedio.db.migrate import migrate, migrations
from aivedio.db.pool import Database
from aivedio.gateway.store import EventStore
from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import Maintenance
from aivedio.retention.partitions import list_partitions
from tests.integration.helpers import make_project, make_task, store
from tests.integration.legacy_events import database_at, write_old_tasks
from tests.integration.retention_helpers import holes_above_floor

# What every version of task_events stores (0016 dropped columns nobody read: its own test)
EVENTS = """SELECT project_id, epoch, seq, task_id, task_version, public_payload::jsonb AS payload,
                   source, created_at
            FROM task_events ORDER BY project_id, epoch, seq"""


@pytest.fixture
async def old_database(admin_database_url: str) -> AsyncIterator[str]:
    """An empty database migrated to 0011 only (the version before partitions)."""
    async with database_at(admin_database_url, 11) as url:
        yield url


async def rows(db: Database, sql: str) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return [dict(r) for r in await conn.fetch(sql)]


async def test_a_populated_database_is_converted_without_changing_a_row(old_database: str) -> None:
    db = await Database.connect(DatabaseConfig(url=old_database, min_size=1, max_size=4))
    try:
        projects = [await make_project(db, tenant=f"t{i}", project="p") for i in range(3)]
        tasks = store(db)
        async with db.connection() as conn:
            for project in projects:
                await write_old_tasks(conn, project, 3)  # 12 events each
            # Months of history: events spread over the last 40 days, a stream of another epoch
            await conn.execute(
                "UPDATE task_events SET created_at = now() - seq * interval '80 hours'"
            )
            await conn.execute(
                "UPDATE event_streams SET epoch = epoch + 1, floor = head WHERE project_id = $1",
                projects[2].project_id,
            )
        before_events = await rows(db, EVENTS)
        before_streams = await rows(db, "SELECT * FROM event_streams ORDER BY project_id")
        task_ids = await rows(db, "SELECT id, project_id FROM generation_tasks ORDER BY id")
        before_snapshots = [
            await tasks.snapshot(p.principal, p.project_id, t["id"])
            for p in projects
            for t in task_ids
            if t["project_id"] == p.project_id
        ]
        assert len(before_events) == 36

        async with db.connection() as conn:
            assert await migrate(conn) == [m.version for m in migrations() if m.version > 11]

        assert await rows(db, EVENTS) == before_events
        assert await rows(db, "SELECT * FROM event_streams ORDER BY project_id") == before_streams
        after_snapshots = [
            await tasks.snapshot(p.principal, p.project_id, t["id"])
            for p in projects
            for t in task_ids
            if t["project_id"] == p.project_id
        ]
        assert after_snapshots == before_snapshots  # same cursors
        legacy = await rows(db, "SELECT count(*) AS n FROM task_events_legacy")
        assert legacy == [{"n": 36}]
        async with db.connection() as conn:
            names = [p.name for p in await list_partitions(conn)]
        assert names[0] == "task_events_legacy"
        assert len(names) == 8  # legacy (through today) + tomorrow .. today + 7

        # A cursor from before the migration replays the same events.
        events = EventStore(db)
        epoch = before_streams_of(before_streams, projects[0])
        replayed = await events.events(projects[0].project_id, epoch, 3, 12, 100)
        assert [e.seq for e in replayed] == list(range(4, 13))

        # Writes go on from the same heads, in the same epochs.
        await make_task(tasks, projects[0])
        (row,) = await rows(
            db,
            f"SELECT head, epoch FROM event_streams WHERE project_id = '{projects[0].project_id}'",
        )
        assert row["head"] == 13 and row["epoch"] == before_streams_of(before_streams, projects[0])

        # Retention drops the legacy partition once its newest possible row is old enough.
        now = Maintenance(db, RetentionConfig()).run_once
        assert (await now()).partitions_dropped == []
        later = Maintenance(
            db, RetentionConfig(), clock=lambda: datetime.now(UTC) + timedelta(days=9)
        )
        result = await later.run_once()
        assert "task_events_legacy" in result.partitions_dropped
        assert await holes_above_floor(db) == {}
    finally:
        await db.close()


def before_streams_of(streams: list[dict[str, Any]], project: Any) -> int:
    (stream,) = [s for s in streams if s["project_id"] == project.project_id]
    epoch: int = stream["epoch"]
    return epoch
