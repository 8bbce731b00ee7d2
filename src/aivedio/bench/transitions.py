"""``aivedio bench transitions``: applied observations per second through the real state service.

In a scratch database (created for the run, dropped at the end): ``projects`` projects and
``tasks`` tasks created through the real ``TaskStore``. Then ``workers`` asyncio workers sharing one
pool apply provider observations (``running`` with a progress that moves by the coalescing step, so
each one is applied and writes an event) through ``StateService.apply`` for ``seconds`` (or until
``observations`` were given). With ``batch`` > 1 each worker hands ``batch`` observations (of
``batch`` different tasks) at a time to ``StateService.apply_many``: one transaction, one commit.
Then, against the same database, ``pgbench`` runs the same SQL statements per transaction (BEGIN;
``lock_task_for_attempt``; ``write_event``; COMMIT, or for a batch BEGIN;
``lock_tasks_for_attempts``; ``write_events``; COMMIT) with the same number of clients: that is
the ceiling, the speed of the statements without our Python around them.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from aivedio.admin import create_project_in
from aivedio.bench.common import build_options, database_url, scratch_database
from aivedio.bench.transitions_options import ApplyFigures, Options, _Track
from aivedio.bench.transitions_pgbench import _run_pgbench
from aivedio.bench.transitions_report import _report
from aivedio.bench.transitions_script import pgbench_script, pgbench_variables
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    # Every worker (and every pgbench client) needs whole batches of distinct tasks.
    opts = replace(opts, batch=max(1, min(opts.batch, opts.tasks // opts.workers)))
    state_config = settings.state
    step = max(1, state_config.coalesce_min_points)
    print(
        f"transitions: {opts.tasks} tasks in {opts.projects} projects, {opts.workers} workers, "
        + (f"{opts.observations} observations" if opts.observations else f"{opts.seconds:g} s")
        + f", progress step {step}, batch {opts.batch}",
        flush=True,
    )
    async with scratch_database(database_url(settings)) as url:
        config = DatabaseConfig(
            url=url,
            min_size=opts.workers,
            max_size=opts.workers,
            acquire_timeout_s=max(settings.db_acquire_timeout_s, 10.0),
            command_timeout_s=settings.db_command_timeout_s,
        )
        db = await Database.connect(config)
        try:
            state = StateService(db, state_config)
            started = time.perf_counter()
            tracks = await _create_tasks(db, state, opts)
            print(f"  setup: {len(tracks)} tasks in {time.perf_counter() - started:.1f} s")
            ours = await _apply_observations(state, tracks, opts, step)
        finally:
            await db.close()
        pg_seconds = opts.pgbench_seconds or max(1, round(ours.seconds))
        pg, pg_error = await _run_pgbench(url, opts, pg_seconds)
    return _report(opts, ours, pg, pg_error)


# -- setup ----------------------------------------------------------------------------------------


async def _create_tasks(db: Database, state: StateService, opts: Options) -> list[_Track]:
    principals: list[tuple[uuid.UUID, Principal]] = []
    async with db.connection() as conn:
        for i in range(opts.projects):
            made = await create_project_in(conn, "bench", f"bench-{i}")
            principal = Principal(uuid.UUID(made["tenant_id"]), uuid.UUID(made["user_id"]))
            principals.append((uuid.UUID(made["project_id"]), principal))
    store = TaskStore(db, state, timedelta(hours=1))
    body = NewTask(provider="sandbox", model="bench", prompt="a cat on a skateboard", params={})
    queue = collections.deque(range(opts.tasks))

    async def creator() -> None:
        while queue:
            i = queue.popleft()
            project_id, principal = principals[i % len(principals)]
            await store.create(principal, project_id, f"bench-{i}", body, None)

    await asyncio.gather(*(creator() for _ in range(opts.workers)))
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT current_attempt_id FROM generation_tasks ORDER BY created_at, id"
        )
    return [_Track(row["current_attempt_id"]) for row in rows]


# -- our path -------------------------------------------------------------------------------------


async def _apply_observations(
    state: StateService, tracks: list[_Track], opts: Options, step: int
) -> ApplyFigures:
    """Workers take the next task from a round-robin queue (never two at once on one task)."""
    queue = collections.deque(tracks)
    figures = ApplyFigures()
    latencies = figures.latencies_ms
    budget = opts.observations or -1
    deadline = time.perf_counter() + opts.seconds if not opts.observations else float("inf")

    async def worker() -> None:
        nonlocal budget
        while budget != 0 and time.perf_counter() < deadline:
            if not queue:
                figures.exhausted = True
                return
            size = min(opts.batch, len(queue), budget if budget > 0 else opts.batch)
            budget -= size
            batch = [queue.popleft() for _ in range(size)]
            observations = [
                ProviderObservation(
                    provider="sandbox",
                    attempt_id=track.attempt_id,
                    status=ProviderStatus.RUNNING,
                    source=Source.POLL,
                    provider_sequence=track.sequence,
                    provider_occurred_at=datetime.now(UTC),
                    progress=track.progress,
                )
                for track in batch
            ]
            t0 = time.perf_counter()
            if opts.batch == 1:
                results = [await state.apply(observations[0])]
            else:
                results = await state.apply_many(observations)
            latencies.append((time.perf_counter() - t0) * 1000)
            for track, result in zip(batch, results, strict=True):
                if result.outcome is Outcome.APPLIED:
                    figures.applied += 1
                else:
                    figures.ignored += 1
                track.sequence += 1
                track.progress += step
                if track.progress <= 100:
                    queue.append(track)

    started, cpu_started = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(opts.workers)))
    figures.seconds = time.perf_counter() - started
    figures.cpu_seconds = time.process_time() - cpu_started
    return figures


__all__ = ["Options", "pgbench_script", "pgbench_variables", "run"]
