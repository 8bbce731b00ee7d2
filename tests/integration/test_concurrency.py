"""Concurrent appliers and the gap-free cursor (DESIGN.md decision 1), on real PostgreSQL."""

from __future__ import annotations

import asyncio
import random
import uuid

from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import CoalescePolicy
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, make_task, store

WORKERS = 8


def running(attempt_id: uuid.UUID, progress: int) -> ProviderObservation:
    return ProviderObservation(
        provider="sandbox",
        attempt_id=attempt_id,
        status=ProviderStatus.RUNNING,
        source=Source.POLL,
        progress=progress,
    )


def never_coalesce(state: StateService) -> StateService:
    state.policy = CoalescePolicy(min_points=0)
    return state


async def assert_contiguous(db: Database, project_id: uuid.UUID) -> int:
    async with db.connection() as conn:
        seqs = [
            r["seq"]
            for r in await conn.fetch(
                "SELECT seq FROM task_events WHERE project_id = $1 ORDER BY seq", project_id
            )
        ]
        head = await conn.fetchval(
            "SELECT head FROM event_streams WHERE project_id = $1", project_id
        )
        rows = await conn.fetch(
            "SELECT task_id, array_agg(task_version ORDER BY task_version) AS v, max(seq) AS last "
            "FROM task_events WHERE project_id = $1 GROUP BY task_id",
            project_id,
        )
        tasks = {
            r["id"]: r
            for r in await conn.fetch(
                "SELECT id, version, last_event_id FROM generation_tasks WHERE project_id = $1",
                project_id,
            )
        }
        outbox = await conn.fetchval("SELECT count(*) FROM outbox_events")
    assert seqs == list(range(1, head + 1))
    assert outbox == head
    for r in rows:
        assert r["v"] == list(range(1, len(r["v"]) + 1))
        assert tasks[r["task_id"]]["version"] == len(r["v"])
        assert tasks[r["task_id"]]["last_event_id"] == r["last"]
    return head


async def test_eight_appliers_on_one_task_lose_no_update(db: Database) -> None:
    project = await make_project(db)
    state = never_coalesce(StateService(db))
    task_id, attempt_id = await make_task(store(db, state), project)
    progress = list(range(1, 97))
    random.shuffle(progress)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for p in progress:
        queue.put_nowait(p)
    applied: list[int] = []

    async def worker() -> None:
        while not queue.empty():
            p = queue.get_nowait()
            result = await state.apply(running(attempt_id, p))
            if result.event is not None:
                applied.append(p)

    await asyncio.gather(*(worker() for _ in range(WORKERS)))
    head = await assert_contiguous(db, project.project_id)
    assert head == 1 + len(applied)
    assert applied == sorted(applied)  # progress only ever moved forward, in commit order
    async with db.connection() as conn:
        final = await conn.fetchval("SELECT progress FROM generation_tasks WHERE id = $1", task_id)
    assert final == max(progress) == applied[-1]


async def test_eight_appliers_across_one_project_keep_seqs_and_versions_contiguous(
    db: Database,
) -> None:
    project = await make_project(db)
    state = never_coalesce(StateService(db))
    tasks = store(db, state)
    attempts = [(await make_task(tasks, project))[1] for _ in range(16)]

    async def worker(n: int) -> None:
        rng = random.Random(n)
        for p in range(1, 41):
            await state.apply(running(rng.choice(attempts), p))

    await asyncio.gather(*(worker(n) for n in range(WORKERS)))
    head = await assert_contiguous(db, project.project_id)
    assert head > 16


async def test_reader_never_skips_an_event_while_transactions_commit_out_of_order(
    db: Database,
) -> None:
    """Writers hold their transaction open for a random while after taking a seq, so that with
    an identity column later ids would commit first. A reader fetching ``seq > cursor`` again and
    again must see every event exactly once, in order."""
    project = await make_project(db)
    state = never_coalesce(StateService(db))
    tasks = store(db, state)
    attempts = [(await make_task(tasks, project))[1] for _ in range(25)]
    total_writes = 1200
    done = asyncio.Event()
    seen: list[int] = []
    progress = {a: 0 for a in attempts}
    budget = iter(range(total_writes))

    async def writer(n: int) -> None:
        rng = random.Random(n)
        for _ in budget:
            attempt = rng.choice(attempts)
            if progress[attempt] == 100:
                continue
            progress[attempt] += 1
            async with db.transaction() as conn:
                await conn.execute("SELECT pg_sleep($1)", rng.random() * 0.002)
                await state.apply_in(conn, running(attempt, progress[attempt]))
                await conn.execute("SELECT pg_sleep($1)", rng.random() * 0.003)

    async def reader() -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            async with db.connection() as conn:
                rows = await conn.fetch(
                    "SELECT seq FROM task_events WHERE project_id = $1 AND seq > $2 ORDER BY seq",
                    project.project_id,
                    cursor,
                )
            for r in rows:
                assert r["seq"] == cursor + 1, f"skipped from {cursor} to {r['seq']}"
                cursor = r["seq"]
                seen.append(cursor)
            if finished:
                return
            await asyncio.sleep(0)

    read = asyncio.create_task(reader())
    await asyncio.gather(*(writer(n) for n in range(WORKERS)))
    done.set()
    await read
    head = await assert_contiguous(db, project.project_id)
    assert seen == list(range(1, head + 1))
    assert len(seen) >= 1000
