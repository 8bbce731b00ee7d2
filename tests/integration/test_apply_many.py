"""``StateService.apply_many`` (group commit) on real PostgreSQL: the same rows as ``apply`` one
by one, no deadlock between concurrent batches, a gap-free cursor, failure isolation, and nothing
partial when the database goes away."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import (
    Observation,
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.domain.statuses import Stage
from aivedio.domain.transitions import CoalescePolicy, Outcome
from aivedio.errors import DatabaseUnavailable
from aivedio.state.service import BATCHES, ApplyResult, BatchPartlyFailed, StateService
from tests.integration.helpers import Project, make_project, make_task, store
from tests.integration.test_api_database_down import via
from tests.model import T0, Script, scripts
from tests.proxy import TcpProxy
from tests.unit.test_transitions import prov

CURRENT = uuid.UUID(int=1)
OLD = uuid.UUID(int=2)
RECEIVED = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def running(attempt_id: uuid.UUID, progress: int, source: Source = Source.POLL) -> Observation:
    return ProviderObservation(
        provider="sandbox",
        attempt_id=attempt_id,
        status=ProviderStatus.RUNNING,
        source=source,
        progress=progress,
    )


def never_coalesce(state: StateService) -> StateService:
    state.policy = CoalescePolicy(min_points=0)
    return state


def batches_one_by_one() -> float:
    for metric in BATCHES.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.labels == {"result": "one_by_one"}:
                return sample.value
    return 0.0


# -- same rows as apply one by one ----------------------------------------------------------------


class World:
    """Projects and tasks made the same way twice: one world applies one by one, the other in
    batches; ``names`` maps every id of the world to a name both worlds share."""

    def __init__(self, db: Database, clock: Clock, label: str) -> None:
        self.db = db
        self.state = StateService(db, clock=clock)
        self.label = label
        self.trace_prefix = f"trc_{uuid.uuid4().hex[:8]}"  # trace ids as aivedio makes them
        self.names: dict[str, str] = {}
        self.projects: list[Project] = []
        self.attempts: list[uuid.UUID] = []
        self.unknown: list[uuid.UUID] = []

    async def build(self, tasks: int, projects: int) -> None:
        for p in range(projects):
            project = await make_project(db=self.db, tenant=f"{self.label}-{uuid.uuid4().hex}")
            self.projects.append(project)
            self.names[str(project.project_id)] = f"project-{p}"
            self.names[str(project.tenant_id)] = "tenant"
            self.names[str(project.principal.user_id)] = "user"
        for t in range(tasks):
            task_id, attempt_id = await make_task(
                store(self.db, self.state), self.projects[t % projects]
            )
            self.attempts.append(attempt_id)
            self.unknown.append(uuid.uuid4())
            self.names[str(task_id)] = f"task-{t}"
            self.names[str(attempt_id)] = f"attempt-{t}"

    def observation(self, task: int, obs: ProviderObservation, n: int) -> Observation:
        target = self.attempts[task] if obs.attempt_id == CURRENT else self.unknown[task]
        return ProviderObservation(
            provider=obs.provider,
            attempt_id=target,
            status=obs.status,
            source=obs.source,
            provider_sequence=obs.provider_sequence,
            progress=obs.progress,
            received_at=RECEIVED,
            dedup_key=f"{self.label}-{n}",
            trace_id=f"{self.trace_prefix}{n:016x}" if n % 3 == 0 else None,
        )

    def name(self, value: Any) -> Any:
        if isinstance(value, uuid.UUID):
            return self.names.get(str(value), "?")
        if isinstance(value, str):
            if value.startswith(self.trace_prefix):  # a trace id of this world
                return "trace-" + value[len(self.trace_prefix) :]
            if value.startswith(f"{self.label}-"):  # a dedup key of this world
                return "world" + value[len(self.label) :]
            return self.names.get(value, value)
        if isinstance(value, dict):
            return {k: self.name(v) for k, v in value.items() if k != "epoch"}
        if isinstance(value, list):
            return [self.name(v) for v in value]
        return value

    async def rows(self) -> dict[str, Any]:
        """Everything the state service wrote, named, without times that differ by nature."""
        projects = [p.project_id for p in self.projects]
        tasks_q = (
            "SELECT id, status, stage, progress, version, last_event_id, error_code,"
            " error_message, asset_id, terminal_at IS NULL AS open, trace_id"
            " FROM generation_tasks WHERE project_id = ANY($1) ORDER BY id"
        )
        async with self.db.connection() as conn:
            fetched = {
                "tasks": await conn.fetch(tasks_q, projects),
                "attempts": await conn.fetch(
                    "SELECT a.id, provider_status, last_provider_seq, last_provider_at,"
                    " next_poll_at IS NULL AS unpolled FROM task_attempts a"
                    " JOIN generation_tasks t ON t.id = a.task_id"
                    " WHERE t.project_id = ANY($1) ORDER BY a.id",
                    projects,
                ),
                "events": await conn.fetch(
                    "SELECT project_id, seq, task_id, task_version, public_payload, source,"
                    " 'trc_' || encode(trace_id, 'hex') AS trace_id FROM task_events"
                    " WHERE project_id = ANY($1) AND task_version > 1 ORDER BY project_id, seq",
                    projects,
                ),
                "outbox": await conn.fetch(
                    "SELECT o.aggregate_id, o.aggregate_version, o.event_type, o.payload"
                    " FROM outbox_events o"
                    " JOIN generation_tasks t ON t.id = o.aggregate_id"
                    " WHERE t.project_id = ANY($1) AND o.aggregate_version > 1"
                    " ORDER BY o.aggregate_id, o.aggregate_version",
                    projects,
                ),
                "audit": await conn.fetch(
                    "SELECT task_id, attempt_id, project_id, outcome, reason, source, observed,"
                    " provider_sequence, progress, task_version, trace_id, dedup_key"
                    " FROM observation_audit WHERE dedup_key LIKE $1 || '-%'"
                    " ORDER BY task_id, id",
                    self.label,
                ),
                "items": await conn.fetch(
                    "SELECT kind, task_id, attempt_id, state, detail FROM reconciliation_items"
                    " WHERE project_id = ANY($1) ORDER BY task_id, kind",
                    projects,
                ),
                "streams": await conn.fetch(
                    "SELECT project_id, head FROM event_streams WHERE project_id = ANY($1)",
                    projects,
                ),
            }
        named = {key: [self.name(dict(r)) for r in rows] for key, rows in fetched.items()}
        # by task (or project) name, stable: per task in the order the database gave them
        return {key: sorted(rows, key=_owner) for key, rows in named.items()}


def _owner(row: dict[str, Any]) -> str:
    for key in ("task_id", "aggregate_id", "id", "project_id"):
        if key in row:
            return repr(row[key])
    return ""


def interleave(scripts_: list[Script], order: list[int]) -> list[tuple[int, ProviderObservation]]:
    """The arrivals of every script, interleaved: ``order`` says which script goes next."""
    queues = [list(s.arrivals) for s in scripts_]
    out: list[tuple[int, ProviderObservation]] = []
    for pick in order:
        live = [i for i, q in enumerate(queues) if q]
        if not live:
            break
        i = live[pick % len(live)]
        out.append((i, queues[i].pop(0)))
    for i, q in enumerate(queues):
        out.extend((i, o) for o in q)
    return out


async def replay_both(
    url: str, scripts_: list[Script], order: list[int], cuts: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=2))
    try:
        clock = Clock()
        run = uuid.uuid4().hex[:8]  # examples share the database
        one, many = World(db, clock, f"one{run}"), World(db, clock, f"many{run}")
        for world in (one, many):
            await world.build(len(scripts_), projects=min(2, len(scripts_)))
        arrivals = list(enumerate(interleave(scripts_, order)))
        clock.now = T0  # one decision time: a batch is decided at one moment
        singles = [await one.state.apply(one.observation(t, o, n)) for n, (t, o) in arrivals]
        batched: list[ApplyResult] = []
        start, sizes = 0, iter(cuts)
        while start < len(arrivals):
            chunk = arrivals[start : start + next(sizes, 5)]
            batched += await many.state.apply_many(
                [many.observation(t, o, n) for n, (t, o) in chunk]
            )
            start += len(chunk)
        assert [(r.outcome, r.reason, r.task_version) for r in singles] == [
            (r.outcome, r.reason, r.task_version) for r in batched
        ]
        return await one.rows(), await many.rows()
    finally:
        await db.close()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    scripts_=st.lists(scripts(CURRENT, OLD), min_size=1, max_size=3),
    order=st.lists(st.integers(0, 2), max_size=60),
    cuts=st.lists(st.integers(1, 12), max_size=20),
)
def test_apply_many_writes_exactly_what_apply_writes_one_by_one(
    database_url: str, scripts_: list[Script], order: list[int], cuts: list[int]
) -> None:
    one, many = asyncio.run(replay_both(database_url, scripts_, order, cuts))
    for key in one:
        assert one[key] == many[key], key


def lifecycle(attempt_id: uuid.UUID, asset: uuid.UUID) -> list[Observation]:
    """A task's whole life with a backwards progress, a contradicting terminal and media."""

    def provider(status: ProviderStatus, source: Source = Source.WEBHOOK) -> Observation:
        return ProviderObservation(
            provider="sandbox", attempt_id=attempt_id, status=status, source=source
        )

    def media(stage: Stage) -> Observation:
        return PlatformObservation(
            kind=PlatformKind.MEDIA_STAGE, attempt_id=attempt_id, source=Source.MEDIA, stage=stage
        )

    return [
        running(attempt_id, 10, Source.WEBHOOK),
        running(attempt_id, 5),
        running(attempt_id, 40),
        provider(ProviderStatus.SUCCEEDED),
        media(Stage.INGESTING),
        media(Stage.PROBING),
        provider(ProviderStatus.FAILED, Source.POLL),
        media(Stage.TRANSCODING),
        PlatformObservation(
            kind=PlatformKind.MEDIA_READY,
            attempt_id=attempt_id,
            source=Source.MEDIA,
            asset_id=asset,
        ),
        running(uuid.uuid4(), 50),
    ]


async def task_rows(db: Database, task_id: uuid.UUID, attempt_id: uuid.UUID) -> list[Any]:
    """One task's rows as the state service left them: task, attempt, events, audit, items."""
    async with db.connection() as conn:
        task = await conn.fetchrow(
            "SELECT status, stage, progress, version, last_event_id, asset_id,"
            " terminal_at IS NULL AS open FROM generation_tasks WHERE id = $1",
            task_id,
        )
        attempt = await conn.fetchrow(
            "SELECT provider_status, last_provider_seq, last_provider_at,"
            " next_poll_at IS NULL AS unpolled"
            " FROM task_attempts WHERE id = $1",
            attempt_id,
        )
        events = await conn.fetch(
            "SELECT seq, task_version, public_payload::jsonb - 'task_id' AS p, source"
            " FROM task_events WHERE task_id = $1 ORDER BY seq",
            task_id,
        )
        # In decided order: a batch writes the audit rows of unapplied observations before
        # its events, and those of versions that are no public event with them.
        audit = await conn.fetch(
            "SELECT outcome, reason, observed, task_version FROM observation_audit"
            " WHERE task_id = $1 ORDER BY task_version, outcome <> 'applied', id",
            task_id,
        )
        items = await conn.fetch(
            "SELECT kind, state FROM reconciliation_items WHERE task_id = $1", task_id
        )
    assert task is not None and attempt is not None
    return [dict(task), dict(attempt), *map(dict, events), *map(dict, audit), *map(dict, items)]


async def two_tasks(
    db: Database, state: StateService
) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, uuid.UUID]:
    """A task (and its attempt) in each of two projects: one applied to one by one, the other
    in batches."""
    one = await make_project(db, tenant="one")
    many = await make_project(db, tenant="many")
    one_task, one_attempt = await make_task(store(db, state), one)
    many_task, many_attempt = await make_task(store(db, state), many)
    return one_task, one_attempt, many_task, many_attempt


async def test_one_task_many_times_in_one_batch_evolves_as_one_by_one(db: Database) -> None:
    state = StateService(db)
    asset = uuid.uuid4()
    one_task, one_attempt, many_task, many_attempt = await two_tasks(db, state)
    singles = [await state.apply(o) for o in lifecycle(one_attempt, asset)]
    batched = await state.apply_many(lifecycle(many_attempt, asset))
    assert [(r.outcome, r.reason, r.task_version) for r in singles] == [
        (r.outcome, r.reason, r.task_version) for r in batched
    ]
    assert [r.event.seq if r.event else None for r in singles] == [
        r.event.seq if r.event else None for r in batched
    ]
    assert {r.outcome for r in batched} == {Outcome.APPLIED, Outcome.IGNORED, Outcome.CONFLICT}

    assert await task_rows(db, one_task, one_attempt) == await task_rows(
        db, many_task, many_attempt
    )


def coalesced(attempt_id: uuid.UUID) -> list[Observation]:
    """On a task running at 10 %: steps too small to write (each teaches the attempt its
    sequence), one older than them, one for an attempt nobody knows."""
    return [
        prov(ProviderStatus.RUNNING, seq=2, progress=11, attempt_id=attempt_id),
        prov(ProviderStatus.RUNNING, seq=4, progress=13, attempt_id=attempt_id),
        prov(ProviderStatus.RUNNING, seq=1, progress=30, attempt_id=attempt_id),
        prov(ProviderStatus.RUNNING, seq=3, progress=12, attempt_id=attempt_id),
        running(uuid.uuid4(), 50),
    ]


def contradictions(attempt_id: uuid.UUID) -> list[Observation]:
    """On a finished task: late progress, two contradicting terminals (one open item), the
    terminal again."""
    return [
        prov(ProviderStatus.RUNNING, seq=7, progress=20, attempt_id=attempt_id),
        prov(ProviderStatus.FAILED, seq=8, attempt_id=attempt_id),
        prov(ProviderStatus.FAILED, seq=9, attempt_id=attempt_id),
        prov(ProviderStatus.SUCCEEDED, seq=10, attempt_id=attempt_id),
    ]


async def test_batches_of_unapplied_observations_are_audited_as_one_by_one(db: Database) -> None:
    """Batches whose observations all change nothing write their audit rows in one statement:
    the same rows in the same order as one by one, the attempt with the values the last of them
    taught it, one open reconciliation item per kind."""
    state = StateService(db)
    asset = uuid.uuid4()
    one_task, one_attempt, many_task, many_attempt = await two_tasks(db, state)
    for attempt in (one_attempt, many_attempt):
        await state.apply(prov(ProviderStatus.RUNNING, seq=0, progress=10, attempt_id=attempt))
    for phase in (coalesced, lambda a: [*lifecycle(a, asset), *contradictions(a)]):
        singles = [await state.apply(o) for o in phase(one_attempt)]
        batched = await state.apply_many(phase(many_attempt))
        assert [(r.outcome, r.reason) for r in singles] == [(r.outcome, r.reason) for r in batched]
        assert await task_rows(db, one_task, one_attempt) == await task_rows(
            db, many_task, many_attempt
        )
        if phase is coalesced:
            assert all(r.outcome is not Outcome.APPLIED for r in batched)
            async with db.connection() as conn:
                seq = await conn.fetchval(
                    "SELECT last_provider_seq FROM task_attempts WHERE id = $1", many_attempt
                )
            assert seq == 4  # taught by the second; the two older ones after it are stale
    async with db.connection() as conn:
        items = await conn.fetchval(
            "SELECT count(*) FROM reconciliation_items WHERE task_id = $1", many_task
        )
    assert items == 1


# -- concurrency and the cursor -------------------------------------------------------------------

WORKERS = 8


async def check_streams(db: Database, projects: list[uuid.UUID]) -> int:
    """Per project: seqs 1..head; per task: versions 1..n, ``last_event_id`` its last seq; one
    outbox row per event."""
    total = 0
    async with db.connection() as conn:
        for project_id in projects:
            seqs = [
                r["seq"]
                for r in await conn.fetch(
                    "SELECT seq FROM task_events WHERE project_id = $1 ORDER BY seq", project_id
                )
            ]
            head = await conn.fetchval(
                "SELECT head FROM event_streams WHERE project_id = $1", project_id
            )
            assert seqs == list(range(1, head + 1))
            total += head
        rows = await conn.fetch(
            "SELECT e.task_id, array_agg(e.task_version ORDER BY e.task_version) AS v,"
            " max(e.seq) AS last, t.version, t.last_event_id"
            " FROM task_events e JOIN generation_tasks t ON t.id = e.task_id"
            " GROUP BY e.task_id, t.version, t.last_event_id"
        )
        outbox = await conn.fetchval("SELECT count(*) FROM outbox_events")
    assert outbox == total
    for r in rows:
        assert r["v"] == list(range(1, len(r["v"]) + 1))
        assert r["version"] == len(r["v"]) and r["last_event_id"] == r["last"]
    return total


async def test_eight_batch_appliers_across_three_projects_do_not_deadlock(db: Database) -> None:
    state = never_coalesce(StateService(db))
    projects = [await make_project(db, tenant=f"t{i}", project=f"p{i}") for i in range(3)]
    tasks = store(db, state)
    attempts = [(await make_task(tasks, projects[i % 3]))[1] for i in range(12)]
    fallbacks = batches_one_by_one()

    async def worker(n: int) -> None:
        rng = random.Random(n)
        for p in range(1, 31):
            # overlapping tasks, several projects, sometimes one task twice in a batch
            batch = [running(rng.choice(attempts), p) for _ in range(rng.randint(2, 8))]
            await state.apply_many(batch)

    await asyncio.gather(*(worker(n) for n in range(WORKERS)))
    assert batches_one_by_one() == fallbacks  # no batch failed (a deadlock would have)
    total = await check_streams(db, [p.project_id for p in projects])
    assert total > 12


async def test_reader_never_skips_an_event_while_batches_commit_out_of_order(
    db: Database,
) -> None:
    """The cursor test of ``test_concurrency`` with batch writers: each batch holds its
    transaction open for a random while before and after writing; readers of each project
    fetching ``seq > cursor`` must see every event exactly once, in order."""
    state = never_coalesce(StateService(db))
    projects = [await make_project(db, tenant=f"t{i}", project=f"p{i}") for i in range(3)]
    tasks = store(db, state)
    attempts = [(await make_task(tasks, projects[i % 3]))[1] for i in range(24)]
    progress = {a: 0 for a in attempts}
    budget = iter(range(400))
    done = asyncio.Event()
    seen: dict[uuid.UUID, list[int]] = {p.project_id: [] for p in projects}

    async def writer(n: int) -> None:
        rng = random.Random(n)
        for _ in budget:
            batch: list[Observation] = []
            for attempt in rng.sample(attempts, 4):
                if progress[attempt] < 100:
                    progress[attempt] += 1
                    batch.append(running(attempt, progress[attempt]))
            async with db.transaction() as conn:
                await conn.execute("SELECT pg_sleep($1)", rng.random() * 0.002)
                await state.apply_many_in(conn, batch)
                await conn.execute("SELECT pg_sleep($1)", rng.random() * 0.003)

    async def reader(project_id: uuid.UUID) -> None:
        cursor = 0
        while True:
            finished = done.is_set()
            async with db.connection() as conn:
                rows = await conn.fetch(
                    "SELECT seq FROM task_events WHERE project_id = $1 AND seq > $2 ORDER BY seq",
                    project_id,
                    cursor,
                )
            for r in rows:
                assert r["seq"] == cursor + 1, f"skipped from {cursor} to {r['seq']}"
                cursor = r["seq"]
                seen[project_id].append(cursor)
            if finished:
                return
            await asyncio.sleep(0)

    reads = [asyncio.create_task(reader(p.project_id)) for p in projects]
    await asyncio.gather(*(writer(n) for n in range(WORKERS)))
    done.set()
    await asyncio.gather(*reads)
    total = await check_streams(db, list(seen))
    assert sum(len(s) for s in seen.values()) == total >= 1000


# -- failures -------------------------------------------------------------------------------------


async def test_a_poison_observation_does_not_block_the_others(db: Database) -> None:
    project = await make_project(db)
    state = StateService(db)
    made = [await make_task(store(db, state), project) for _ in range(4)]
    poisoned = made[2][0]
    async with db.connection() as conn:
        await conn.execute(
            f"""CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN
                 IF NEW.aggregate_id = '{poisoned}' AND NEW.aggregate_version > 1 THEN
                   RAISE EXCEPTION 'poisoned task';
                 END IF;
                 RETURN NEW;
               END $$;
               CREATE TRIGGER poison BEFORE INSERT ON outbox_events
               FOR EACH ROW EXECUTE FUNCTION poison();"""
        )
    fallbacks = batches_one_by_one()
    with pytest.raises(BatchPartlyFailed) as failed:
        await state.apply_many([running(attempt, 30) for _, attempt in made])
    assert batches_one_by_one() == fallbacks + 1
    results = failed.value.results
    assert isinstance(results[2], asyncpg.PostgresError) and "poisoned" in str(results[2])
    assert [r.outcome for i, r in enumerate(results) if isinstance(r, ApplyResult)] == [
        Outcome.APPLIED
    ] * 3
    async with db.connection() as conn:
        versions = {
            r["id"]: r["version"]
            for r in await conn.fetch("SELECT id, version FROM generation_tasks")
        }
        head = await conn.fetchval("SELECT head FROM event_streams")
    assert [versions[task_id] for task_id, _ in made] == [2, 2, 1, 2]
    assert head == 4 + 3


async def test_database_cut_raises_unavailable_and_writes_nothing(
    database_url: str, db: Database
) -> None:
    project = await make_project(db)
    state = StateService(db)
    made = [await make_task(store(db, state), project) for _ in range(6)]
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    cut_db = await Database.connect(
        DatabaseConfig(
            url=via(database_url, proxy.port), min_size=1, max_size=2, acquire_timeout_s=1.0
        )
    )
    async with db.connection() as conn:  # the batch's write statement takes a while
        await conn.execute(
            """CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$;
               CREATE TRIGGER slow BEFORE INSERT ON outbox_events
               FOR EACH ROW EXECUTE FUNCTION slow();"""
        )
    try:
        cut_state = StateService(cut_db)
        batch = [running(attempt, 30) for _, attempt in made]
        applying = asyncio.create_task(cut_state.apply_many(batch))
        await asyncio.sleep(0.2)
        await proxy.cut()
        with pytest.raises(DatabaseUnavailable):
            await applying
        with pytest.raises(DatabaseUnavailable):  # and while it stays down
            await cut_state.apply_many(batch)
    finally:
        await proxy.cut()
        await cut_db.close()
    async with db.connection() as conn:
        versions = await conn.fetch("SELECT version FROM generation_tasks")
        head = await conn.fetchval("SELECT head FROM event_streams")
        counts = [
            await conn.fetchval(f"SELECT count(*) FROM {t}")
            for t in ("task_events", "outbox_events", "observation_audit")
        ]
        statuses = await conn.fetch("SELECT provider_status FROM task_attempts")
    assert {r["version"] for r in versions} == {1}
    assert head == 6 and counts == [6, 6, 0]
    assert {r["provider_status"] for r in statuses} == {None}
