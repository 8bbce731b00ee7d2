"""Migration 0016 slims a populated task_events: every replay frame, task timeline, audit view
and snapshot reads the same after it as before; new events go on from the same heads."""

from __future__ import annotations

import uuid

from aivedio.config import DatabaseConfig
from aivedio.db.migrate import migrate, migrations
from aivedio.db.pool import Database
from aivedio.domain.public import stored_event
from aivedio.gateway.store import EventStore
from tests.integration.helpers import make_project, make_task, store
from tests.integration.legacy_events import database_at, write_old_tasks

COLUMNS = """SELECT column_name, data_type FROM information_schema.columns
             WHERE table_name = 'task_events' ORDER BY ordinal_position"""

# The rows as each version stores them, read into the same values.
KEPT = "project_id, epoch, seq, task_id, task_version, public_payload::jsonb AS payload, source"
BEFORE = f"""SELECT {KEPT}, trace_id, created_at, event_type FROM task_events
             ORDER BY project_id, seq"""
AFTER = f"""SELECT {KEPT}, 'trc_' || encode(trace_id, 'hex') AS trace_id, created_at
            FROM task_events ORDER BY project_id, seq"""


async def test_a_populated_task_events_is_slimmed_without_changing_what_anyone_reads(
    admin_database_url: str,
) -> None:
    async with database_at(admin_database_url, 15) as url:
        db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=4))
        try:
            projects = [await make_project(db, tenant=f"t{i}", project="p") for i in range(2)]
            tasks = store(db)
            task_ids: dict[uuid.UUID, list[uuid.UUID]] = {}
            async with db.connection() as conn:
                for p in projects:
                    task_ids[p.project_id] = await write_old_tasks(conn, p, 5)
                before = [dict(r) for r in await conn.fetch(BEFORE)]
            snapshots = [
                await tasks.snapshot(p.principal, p.project_id, t)
                for p in projects
                for t in task_ids[p.project_id]
            ]
            assert len(before) == 40 and {r.pop("event_type") for r in before} == {"task.status"}
            assert {len(r["trace_id"] or "") for r in before} == {0, 28, 36}  # 12, 16 bytes

            async with db.connection() as conn:
                assert await migrate(conn) == [m.version for m in migrations() if m.version > 15]
                assert [tuple(r) for r in await conn.fetch(COLUMNS)] == [
                    ("project_id", "uuid"),
                    ("epoch", "bigint"),
                    ("seq", "bigint"),
                    ("task_id", "uuid"),
                    ("task_version", "bigint"),
                    ("public_payload", "json"),
                    ("source", "text"),
                    ("trace_id", "bytea"),
                    ("created_at", "timestamp with time zone"),
                ]
                assert [dict(r) for r in await conn.fetch(AFTER)] == before

            # What clients and the API read of those rows after it.
            rows = {(r["task_id"], r["seq"]): r for r in before}
            events = EventStore(db)
            for p in projects:
                position = await events.position(p.project_id)
                assert position is not None
                frames = await events.events(p.project_id, position.epoch, 0, position.head, 100)
                assert [f.seq for f in frames] == list(range(1, 21))
                for f in frames:
                    row = rows[(uuid.UUID(f.task_id), f.seq)]
                    assert f.data == stored_event(
                        row["payload"], row["task_id"], row["task_version"], f.seq
                    )
                    assert (f.trace_id, f.stored_at) == (
                        row["trace_id"],
                        row["created_at"].timestamp(),
                    )
                for t in task_ids[p.project_id]:
                    audit = await tasks.audit(p.principal, p.project_id, t)
                    mine = sorted((r for r in before if r["task_id"] == t), key=lambda r: r["seq"])
                    assert [
                        (e["event_id"], e["type"], e["source"], e["trace_id"], e["payload"])
                        for e in audit["events"]
                    ] == [
                        (r["seq"], "task.status", r["source"], r["trace_id"],
                         stored_event(r["payload"], t, r["task_version"], r["seq"]))
                        for r in mine
                    ]  # fmt: skip
            assert [
                await tasks.snapshot(p.principal, p.project_id, t)
                for p in projects
                for t in task_ids[p.project_id]
            ] == snapshots

            # A new task's events go on from the same head, written slim, read the same way.
            task_id, _ = await make_task(tasks, projects[0], trace_id="trc_" + "ab" * 12)
            position = await events.position(projects[0].project_id)
            assert position is not None and position.head == 21
            (frame,) = await events.events(projects[0].project_id, position.epoch, 20, 21, 10)
            assert (frame.task_id, frame.trace_id) == (str(task_id), "trc_" + "ab" * 12)
            timeline = await tasks.events(projects[0].principal, projects[0].project_id, task_id)
            assert [e["payload"]["status"] for e in timeline["events"]] == ["queued"]
        finally:
            await db.close()
