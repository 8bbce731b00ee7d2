"""Retention: partitions dropped after the floors were raised; cursors just below and at the
floor (SSE and WebSocket); interrupted rounds; two rounds at once; outbox and inbox purges."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime, timedelta

import pytest

from aivedio.db.pool import Database
from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import LOCK_KEY, Maintenance
from aivedio.retention.partitions import detach_and_drop, list_partitions, raise_floors
from tests.integration.retention_helpers import age_events, holes_above_floor, stream_row
from tests.integration.test_gateway_harness import EnvFactory, collect, make_env, seqs
from tests.waiting import eventually

__all__ = ["make_env"]

CONFIG = RetentionConfig(batch_size=2)


async def partition_names(db: Database) -> list[str]:
    async with db.connection() as conn:
        return [p.name for p in await list_partitions(conn)]


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_after_a_drop_a_cursor_below_the_floor_resets_and_one_at_it_replays(
    make_env: EnvFactory, transport: str
) -> None:
    env = await make_env(publish=False)
    for _ in range(10):
        await env.new_task()
    epoch, head = await env.head()
    assert head == 10
    old = await age_events(env.db, env.project.project_id, 6, days=10)

    result = await Maintenance(env.db, CONFIG).run_once()

    assert result.partitions_dropped == [old]
    assert old not in await partition_names(env.db)
    assert await stream_row(env.db, env.project.project_id) == (epoch, head, 6)
    assert await holes_above_floor(env.db) == {}

    below = env.client(transport=transport)
    below.view.cursor = f"{epoch}-5"  # just below the floor: seq 6 is gone
    got = await collect(below.connect_once(), lambda fs: any(f.event == "reset" for f in fs))
    assert got[-1].data["reason"] == "below_floor"
    assert got[-1].data["cursor"] == f"{epoch}-{head}"
    assert seqs(got) == []  # never a silent partial replay
    await below.aclose()

    at = env.client(transport=transport)
    at.view.cursor = f"{epoch}-6"  # at the floor: 7..10 are all there
    got = await collect(at.connect_once(), lambda fs: len(seqs(fs)) >= 4)
    assert seqs(got) == [7, 8, 9, 10]
    assert not [f for f in got if f.event == "reset"]
    await at.aclose()


async def test_snapshots_of_tasks_whose_events_were_dropped_stay_correct(
    make_env: EnvFactory,
) -> None:
    env = await make_env(publish=False)
    task_id, _ = await env.new_task()
    before = await env.tasks.snapshot(env.project.principal, env.project.project_id, task_id)
    await age_events(env.db, env.project.project_id, 2, days=10)
    await Maintenance(env.db, CONFIG).run_once()
    after = await env.tasks.snapshot(env.project.principal, env.project.project_id, task_id)
    assert after == before  # the snapshot reads the task row, never the events
    epoch, head = await env.head()
    assert after["cursor"] == f"{epoch}-{head}"


async def test_an_interrupted_round_leaves_no_hole_above_any_floor(make_env: EnvFactory) -> None:
    """Raise the floors, then die (before the detach); then a detach that is cut off while it
    waits (detach pending); then the next round. After every step, every seq above every floor
    is stored; the floors only move up."""
    env = await make_env(publish=False)
    for _ in range(6):
        await env.new_task()
    epoch, head = await env.head()
    old = await age_events(env.db, env.project.project_id, 4, days=9)
    assert await holes_above_floor(env.db) == {}

    async with env.db.connection() as conn:  # step 1 only: SIGKILL right after it
        assert await raise_floors(conn, old, batch=1) == 1
    assert await stream_row(env.db, env.project.project_id) == (epoch, head, 4)
    assert await holes_above_floor(env.db) == {}
    replay = env.client()
    replay.view.cursor = f"{epoch}-4"
    got = await collect(replay.connect_once(), lambda fs: len(seqs(fs)) >= 2)
    assert seqs(got) == [5, 6]
    await replay.aclose()

    # A detach cut off while it waits for an older transaction: the partition is left
    # "detach pending" (invisible to new queries, still stored).
    blocker = await env.db.session()
    try:
        await blocker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await blocker.fetchval("SELECT count(*) FROM task_events")
        session = await env.db.session()
        try:
            (partition,) = [p for p in await list_partitions(session) if p.name == old]
            with pytest.raises(TimeoutError):
                await detach_and_drop(session, partition, timeout_s=0.5)
            (partition,) = [p for p in await list_partitions(session) if p.name == old]
            assert partition.detach_pending
        finally:
            await session.close()
        assert await holes_above_floor(env.db) == {}
    finally:
        await blocker.close()

    result = await Maintenance(env.db, CONFIG).run_once()  # the next round finishes the job
    assert result.partitions_dropped == [old]
    assert await stream_row(env.db, env.project.project_id) == (epoch, head, 4)
    assert await holes_above_floor(env.db) == {}
    assert old not in await partition_names(env.db)


async def test_two_rounds_at_once_do_the_work_once(db: Database) -> None:
    from tests.integration.helpers import make_project, make_task, store

    project = await make_project(db)
    for _ in range(4):
        await make_task(store(db), project)
    old = await age_events(db, project.project_id, 3, days=8)

    holder = await db.session()  # another replica in the middle of its round
    try:
        assert await holder.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)
        skipped = await Maintenance(db, CONFIG).run_once()
        assert skipped.skipped and skipped.partitions_dropped == []
        assert old in await partition_names(db)
    finally:
        await holder.close()

    results = await asyncio.gather(*(Maintenance(db, CONFIG).run_once() for _ in range(2)))
    assert sorted(name for r in results for name in r.partitions_dropped) == [old]
    _, head, floor = await stream_row(db, project.project_id)
    assert (head, floor) == (4, 3)


async def test_partitions_are_kept_ahead(db: Database) -> None:
    async with db.connection() as conn:
        for name in await partition_names(db):
            await conn.execute(f'DROP TABLE "{name}"')  # a database whose maintenance never ran
    result = await Maintenance(db, RetentionConfig(partitions_ahead_days=3)).run_once()
    assert result.partitions_created == 4
    today = datetime.now(UTC).date()
    assert await partition_names(db) == [
        f"task_events_p{today + timedelta(days=d):%Y%m%d}" for d in range(4)
    ]
    again = await Maintenance(db, RetentionConfig(partitions_ahead_days=3)).run_once()
    assert again.partitions_created == 0 and again.partitions_dropped == []


async def test_published_outbox_rows_are_deleted_in_batches_after_their_age(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute(
            """INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version,
                   event_type, payload, publish_status, created_at, published_at)
               SELECT 'task', gen_random_uuid(), 1, 'x', '{}'::jsonb, s, c, p
               FROM (VALUES
                   ('published', now() - interval '3 days', now() - interval '3 days'),
                   ('published', now() - interval '3 days', now() - interval '3 days'),
                   ('pending',   now() - interval '3 days', NULL::timestamptz),
                   ('dead',      now() - interval '3 days', NULL),
                   ('published', now() - interval '3 days', now() - interval '2 days'),
                   ('published', now() - interval '3 days', now() - interval '2 days'),
                   ('published', now() - interval '1 hour', now() - interval '1 hour'),
                   ('pending',   now(), NULL)) AS v(s, c, p)"""
        )
    result = await Maintenance(db, CONFIG).run_once()  # batches of 2
    assert result.outbox_deleted == 4
    async with db.connection() as conn:
        left = await conn.fetch("SELECT publish_status FROM outbox_events ORDER BY id")
    assert [r["publish_status"] for r in left] == ["pending", "dead", "published", "pending"]


async def test_inbox_rows_are_deleted_after_the_dedup_window_only_when_processed(
    db: Database,
) -> None:
    async with db.connection() as conn:
        await conn.execute(
            """INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash,
                   process_status, received_at)
               SELECT 'sandbox', 'k' || n, '\\x00'::bytea, s, now() - r
               FROM (VALUES (1, 'processed', interval '8 days'), (2, 'processed', '8 days'),
                            (3, 'dead', '8 days'), (4, 'retry', '8 days'),
                            (5, 'processed', '8 days'), (6, 'processed', '6 days'),
                            (7, 'pending', '1 second')) AS v(n, s, r)"""
        )
    result = await Maintenance(db, CONFIG).run_once()
    assert result.inbox_deleted == 3
    async with db.connection() as conn:
        left = await conn.fetch("SELECT dedup_key FROM provider_callback_inbox ORDER BY id")
    assert [r["dedup_key"] for r in left] == ["k3", "k4", "k6", "k7"]


async def test_a_closed_day_is_packed_once_and_stays_a_partition(make_env: EnvFactory) -> None:
    env = await make_env(publish=False)
    for _ in range(6):
        await env.new_task()
    epoch, _ = await env.head()
    closed = await age_events(env.db, env.project.project_id, 4, days=2)  # kept: 2 < 7 days

    result = await Maintenance(env.db, CONFIG).run_once()
    assert result.partitions_dropped == []
    assert result.partitions_compacted == [closed]
    async with env.db.connection() as conn:
        indexes = await conn.fetch(
            """SELECT c.relname, i.indisvalid, c.reloptions,
                      (SELECT p.inhparent::regclass::text FROM pg_inherits p
                       WHERE p.inhrelid = c.oid) AS parent
               FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
               WHERE i.indrelid = $1::regclass ORDER BY 1""",
            closed,
        )
    assert sorted((r["parent"], r["indisvalid"], r["reloptions"]) for r in indexes) == [
        ("idx_task_events_task", True, ["fillfactor=100"]),
        ("pk_task_events", True, ["fillfactor=100"]),
    ]
    again = await Maintenance(env.db, CONFIG).run_once()
    assert again.partitions_compacted == []

    client = env.client()
    client.view.cursor = f"{epoch}-0"
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 6)
    assert seqs(got) == [1, 2, 3, 4, 5, 6]
    await client.aclose()


async def test_a_round_killed_while_it_detaches_loses_no_event_above_a_floor(
    make_env: EnvFactory, database_url: str
) -> None:
    """``aivedio admin maintenance`` is SIGKILLed between the floors and the drop (its detach
    waits for an older transaction); every seq above every floor is still stored, whatever the
    server then finishes; the next round drops what is left."""
    env = await make_env(publish=False)
    for _ in range(6):
        await env.new_task()
    epoch, head = await env.head()
    old = await age_events(env.db, env.project.project_id, 3, days=12)
    blocker = await env.db.session()  # an older transaction the detach has to wait for
    await blocker.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    await blocker.fetchval("SELECT count(*) FROM task_events")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aivedio",
        "admin",
        "maintenance",
        env={**os.environ, "AIVEDIO_DATABASE_URL": database_url},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:

        async def detaching() -> list[str]:
            async with env.db.connection() as conn:
                return [p.name for p in await list_partitions(conn) if p.detach_pending]

        # until the detach is under way (floors raised before)
        pending = await eventually(detaching, "the detach under way", 30, interval=0.05)
        assert pending == [old]
        assert await stream_row(env.db, env.project.project_id) == (epoch, head, 3)
        assert await holes_above_floor(env.db) == {}
        async with env.db.connection() as conn:  # the round's server backend: it outlives it
            orphans = await conn.fetch(
                "SELECT pid FROM pg_locks"
                " WHERE locktype = 'advisory' AND classid = 0 AND objid = $1 AND objsubid = 1",
                LOCK_KEY & 0xFFFFFFFF,
            )
        assert len(orphans) == 1
    finally:
        proc.kill()
        await proc.wait()
        await blocker.close()
    assert await holes_above_floor(env.db) == {}

    async def orphan_gone() -> bool:
        # The killed round's backend finishes the detach on its own, then finds its client gone
        # and exits; until then it holds the round's advisory lock and a new round is skipped.
        async with env.db.connection() as conn:
            alive = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", orphans[0]["pid"]
            )
        return alive == 0

    await eventually(orphan_gone, "the killed round's server backend to exit")
    result = await Maintenance(env.db, CONFIG).run_once()
    assert not result.skipped
    assert result.partitions_dropped == [old]  # finalized and dropped, or dropped if detached
    assert await holes_above_floor(env.db) == {}
    async with env.db.connection() as conn:
        assert await conn.fetchval("SELECT to_regclass($1)", old) is None
    client = env.client(transport="ws")
    client.view.cursor = f"{epoch}-3"
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 3)
    assert seqs(got) == [4, 5, 6]
    await client.aclose()
