"""``aivedio bench propagation``: outbox -> relay -> JetStream -> dispatcher -> Redis Pub/Sub.

In a scratch database and a private JetStream stream (both removed at the end), with a Redis
subscriber in this process counting every event on a private channel:

(a) **drain**: ``events`` outbox rows (``tasks`` tasks, their versions interleaved, payloads shaped
    like the state service's) are inserted with SQL, then ``relays`` relays and one dispatcher
    start (in child processes, as separate roles would run) and the clock runs until the
    subscriber has every (task, version); ``per_s`` = events / seconds. Every event is accounted
    for: missing, duplicate and out-of-order counts are printed and must be 0.
(b) **latency**: ``rate`` observations/s for ``seconds`` through ``StateService.apply`` on
    ``latency_tasks`` tasks in ``projects`` projects; latency = the subscriber's receive time
    minus the event row's ``created_at`` (``clock_timestamp()`` when it was written, just before
    the commit: an upper bound of commit -> publish); ``p50_ms``, ``p99_ms``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import redis.asyncio as aioredis

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
from aivedio.bus import BusConfig
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
    redis_client,
)
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from aivedio.runtime import resolve_urls
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore

__all__ = ["run"]


@dataclass(frozen=True, slots=True)
class Options:
    events: int = 50_000
    tasks: int = 5_000
    relays: int = 3
    batch: int = 1000
    in_flight: int = 1024
    rate: int = 1000
    seconds: float = 10.0
    latency_tasks: int = 1000
    projects: int = 32
    workers: int = 64
    timeout: float = 120.0

    def check(self) -> None:
        for name in ("tasks", "relays", "batch", "in_flight", "latency_tasks", "projects"):
            if getattr(self, name) < 1:
                raise BenchUsageError(f"{name} must be at least 1")
        if self.events < 0 or self.rate < 0 or self.seconds < 0 or self.workers < 1:
            raise BenchUsageError("events, rate and seconds cannot be negative")


@dataclass(slots=True)
class Counted:
    """What the subscriber saw."""

    first: dict[tuple[str, int], float] = field(default_factory=dict)  # receive time
    duplicates: int = 0
    out_of_order: int = 0
    last_version: dict[str, int] = field(default_factory=dict)


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    urls = resolve_urls(settings)
    tag = uuid.uuid4().hex[:10]
    bus_cfg = BusConfig(
        url=urls.nats_url,
        stream=f"BENCH_{tag}",
        subject_prefix=f"bench{tag}",
        max_in_flight=opts.in_flight,
        max_ack_pending=20_000,
    )
    prefix = f"bench{tag}"
    print(
        f"propagation: drain {opts.events} outbox rows ({opts.tasks} tasks), {opts.relays} "
        f"relay(s) + 1 dispatcher in child processes; then {opts.rate} events/s for "
        f"{opts.seconds:g} s through StateService.apply",
        flush=True,
    )
    figures: dict[str, Any] = {"bench": "propagation"}
    async with scratch_database(database_url(settings)) as url:
        redis = aioredis.Redis.from_url(urls.redis_url)
        counted = Counted()
        reader = await _subscribe(redis, broadcast_channel(prefix), counted)
        try:
            figures |= await _drain(url, bus_cfg, urls.redis_url, prefix, opts, counted)
            figures |= await _latency(settings, url, bus_cfg, urls.redis_url, prefix, opts, counted)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await redis.aclose()
            await _delete_streams(bus_cfg)
    figures["ok"] = all(
        figures.get(k, 0) == 0 for k in ("missing", "duplicates_at_subscriber", "latency_missing")
    )
    print_json_line(figures)
    return 0 if figures["ok"] else 1


# -- the subscriber --------------------------------------------------------------------------


async def _subscribe(redis: aioredis.Redis, channel: str, counted: Counted) -> asyncio.Task[None]:
    pubsub = redis.pubsub()
    await pubsub.subscribe(channel)

    async def read() -> None:
        try:
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None or msg["type"] != "message":
                    continue
                now = time.time()
                body = json.loads(msg["data"])
                key = (body["task_id"], body["task_version"])
                if key in counted.first:
                    counted.duplicates += 1
                    continue
                counted.first[key] = now
                if body["task_version"] <= counted.last_version.get(key[0], 0):
                    counted.out_of_order += 1
                counted.last_version[key[0]] = body["task_version"]
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    return asyncio.create_task(read())


# -- the pipeline in child processes ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChildSpec:
    database_url: str
    bus: BusConfig
    redis_url: str
    prefix: str
    relays: int
    dispatchers: int
    batch: int


def _child(spec: ChildSpec, ready: Any, stop: Any) -> None:
    asyncio.run(_child_main(spec, ready, stop))


async def _child_main(spec: ChildSpec, ready: Any, stop: Any) -> None:
    from aivedio.bus.jetstream import JetStreamBus

    db = await Database.connect(
        DatabaseConfig(url=spec.database_url, min_size=1, max_size=spec.relays + 2)
    )
    bus = await JetStreamBus.connect(spec.bus)
    client = redis_client(spec.redis_url)
    stopping = asyncio.Event()
    relay_cfg = RelayConfig(batch_size=spec.batch, stats_interval_s=3600)
    dispatch_cfg = DispatcherConfig(channel_prefix=spec.prefix, batch_size=spec.batch)
    loops = [OutboxRelay(db, bus, relay_cfg).run for _ in range(spec.relays)]
    loops += [
        NotificationDispatcher(bus, client, dispatch_cfg).run for _ in range(spec.dispatchers)
    ]
    jobs = [asyncio.create_task(loop(stopping)) for loop in loops]
    ready.set()
    while not stop.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.05)
    stopping.set()
    await asyncio.gather(*jobs, return_exceptions=True)
    await client.aclose()
    await bus.close()
    await db.close()


@contextlib.asynccontextmanager
async def _pipeline(specs: list[ChildSpec]) -> Any:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    children = []
    for spec in specs:
        ready = ctx.Event()
        proc = ctx.Process(target=_child, args=(spec, ready, stop), daemon=True)
        proc.start()
        children.append((proc, ready))
    try:
        for proc, ready in children:
            while not ready.is_set():
                if not proc.is_alive():
                    raise RuntimeError("a pipeline process failed to start")
                await asyncio.sleep(0.02)
        yield
    finally:
        stop.set()
        for proc, _ in children:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()


def _specs(url: str, bus: BusConfig, redis_url: str, prefix: str, opts: Options) -> list[ChildSpec]:
    base = ChildSpec(url, bus, redis_url, prefix, relays=1, dispatchers=0, batch=opts.batch)
    return [base for _ in range(opts.relays)] + [replace(base, relays=0, dispatchers=1)]


# -- (a) drain -------------------------------------------------------------------------------

FILL = """
WITH t AS MATERIALIZED (
    SELECT n, gen_random_uuid() AS id FROM generate_series(0, $1 - 1) AS n
)
INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
SELECT 'task', t.id, g.v, 'task.status.changed', jsonb_build_object(
    'event_type', 'task.status.changed', 'aggregate_id', t.id, 'aggregate_version', g.v,
    'tenant_id', $3::uuid, 'project_id', $4::uuid, 'user_id', $3::uuid,
    'attempt_id', gen_random_uuid(), 'status', 'running', 'public_status', 'generating',
    'stage', 'generating', 'progress', least(99, g.v * 5), 'terminal', false,
    'asset_id', NULL, 'error_code', NULL, 'source', 'poll', 'occurred_at', now(),
    'trace_id', 'trc_' || md5(t.id::text || g.v),
    'public', jsonb_build_object('task_id', t.id, 'task_version', g.v, 'status', 'generating',
                                 'stage', 'generating', 'progress', least(99, g.v * 5),
                                 'asset_id', NULL, 'error', NULL),
    'event_id', (g.v - 1) * $1 + t.n + 1, 'epoch', 1)
FROM generate_series(1, $2) AS g(v) CROSS JOIN t
ORDER BY g.v, t.n
"""


async def _drain(
    url: str, bus: BusConfig, redis_url: str, prefix: str, opts: Options, counted: Counted
) -> dict[str, Any]:
    if opts.events == 0:
        return {}
    per_task = max(1, opts.events // opts.tasks)
    total = per_task * opts.tasks
    conn = await asyncpg.connect(url)
    try:
        started = time.perf_counter()
        await conn.execute(FILL, opts.tasks, per_task, uuid.uuid4(), uuid.uuid4())
        await conn.execute("VACUUM ANALYZE outbox_events")
        print(f"  setup: {total} outbox rows in {time.perf_counter() - started:.1f} s", flush=True)
        before = len(counted.first)
        async with _pipeline(_specs(url, bus, redis_url, prefix, opts)):
            started = time.perf_counter()
            deadline = started + opts.timeout
            while len(counted.first) - before < total and time.perf_counter() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            seconds = time.perf_counter() - started
            await asyncio.sleep(0.5)  # late duplicates would show up now
        published = await conn.fetchval(
            "SELECT count(*) FROM outbox_events WHERE publish_status = 'published'"
        )
    finally:
        await conn.close()
    got = len(counted.first) - before
    per_s = got / seconds if seconds > 0 else 0.0
    print(
        f"  drain:   {per_s:,.0f} events/s  ({got} of {total} delivered in {seconds:.2f} s; "
        f"{published} rows marked published; duplicates at the subscriber {counted.duplicates}, "
        f"out of order {counted.out_of_order})",
        flush=True,
    )
    return {
        "per_s": rounded(per_s, 1),
        "events": total,
        "missing": total - got,
        "duplicates_at_subscriber": counted.duplicates,
        "out_of_order": counted.out_of_order,
        "drain_seconds": rounded(seconds),
        "relays": opts.relays,
    }


# -- (b) latency -----------------------------------------------------------------------------


async def _latency(
    settings: Settings,
    url: str,
    bus: BusConfig,
    redis_url: str,
    prefix: str,
    opts: Options,
    counted: Counted,
) -> dict[str, Any]:
    if opts.rate == 0 or opts.seconds == 0:
        return {}
    db = await Database.connect(
        DatabaseConfig(url=url, min_size=opts.workers, max_size=opts.workers, acquire_timeout_s=30)
    )
    try:
        state = StateService(db, settings.state)
        attempts = await _make_tasks(db, state, opts)
        committed: dict[tuple[str, int], float] = {}
        async with _pipeline(_specs(url, bus, redis_url, prefix, opts)[-2:]):
            await asyncio.sleep(1.0)  # the creations' events drain first
            started = time.perf_counter()
            given, lag = await _steady(state, attempts, opts, committed)
            seconds = time.perf_counter() - started
            deadline = time.perf_counter() + 10
            while not set(committed) <= set(counted.first) and time.perf_counter() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # The reference is the event row's created_at: clock_timestamp() when the statement wrote
        # it, after the stream lock was taken, one commit before it became visible (this
        # machine's clock). A stamp taken in this process after apply() returns lands late
        # whenever its loop lags (it gave negative latencies); this one is an upper bound.
        async with db.connection() as conn:
            rows = await conn.fetch(
                "SELECT task_id::text AS task_id, task_version,"
                " extract(epoch FROM created_at)::float8 AS at FROM task_events"
            )
        for r in rows:
            key = (r["task_id"], r["task_version"])
            if key in committed:
                committed[key] = r["at"]
    finally:
        await db.close()
    latencies = [(counted.first[k] - t) * 1000 for k, t in committed.items() if k in counted.first]
    lost = len(committed) - len(latencies)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(
        f"  latency: event written (just before commit) -> Redis subscriber "
        f"p50 {p50:.2f} ms  p99 {p99:.2f} ms  "
        f"max {max(latencies, default=0):.2f} ms  ({len(committed)} events at "
        f"{len(committed) / seconds:,.0f}/s asked {opts.rate}/s, {given} observations, "
        f"{lost} not received; scheduler lag p99 {percentile(lag, 99):.1f} ms)",
        flush=True,
    )
    return {
        "p50_ms": rounded(p50),
        "p99_ms": rounded(p99),
        "latency_events": len(committed),
        "latency_rate_per_s": rounded(len(committed) / seconds, 1),
        "latency_missing": lost,
    }


async def _make_tasks(db: Database, state: StateService, opts: Options) -> list[uuid.UUID]:
    principals = []
    async with db.connection() as conn:
        for i in range(opts.projects):
            made = await create_project_in(conn, "bench", f"prop-{i}")
            principal = Principal(uuid.UUID(made["tenant_id"]), uuid.UUID(made["user_id"]))
            principals.append((uuid.UUID(made["project_id"]), principal))
    store = TaskStore(db, state, timedelta(hours=1))
    body = NewTask(provider="sandbox", model="bench", prompt="a cat on a skateboard", params={})
    sem = asyncio.Semaphore(opts.workers)

    async def create(i: int) -> uuid.UUID:
        project_id, principal = principals[i % len(principals)]
        async with sem:
            created = await store.create(principal, project_id, uuid.uuid4().hex, body, None)
        async with db.connection() as conn:
            attempt: uuid.UUID = await conn.fetchval(
                "SELECT current_attempt_id FROM generation_tasks WHERE id = $1",
                uuid.UUID(created.snapshot["id"]),
            )
        return attempt

    return list(await asyncio.gather(*(create(i) for i in range(opts.latency_tasks))))


async def _steady(
    state: StateService,
    attempts: list[uuid.UUID],
    opts: Options,
    committed: dict[tuple[str, int], float],
) -> tuple[int, list[float]]:
    """Start ``rate`` applies per second (round robin over the tasks) for ``seconds``."""
    step = max(1, state.policy.min_points)
    total = int(opts.rate * opts.seconds)
    progress = [0] * len(attempts)
    sequence = [0] * len(attempts)
    sem = asyncio.Semaphore(opts.workers)
    lag: list[float] = []
    jobs: list[asyncio.Task[None]] = []

    async def apply(i: int) -> None:
        k = i % len(attempts)
        progress[k] = min(99, progress[k] + step)
        sequence[k] += 1
        obs = ProviderObservation(
            provider="sandbox",
            attempt_id=attempts[k],
            status=ProviderStatus.RUNNING,
            source=Source.POLL,
            provider_sequence=sequence[k],
            provider_occurred_at=datetime.now(UTC),
            progress=progress[k],
        )
        async with sem:
            result = await state.apply(obs)
        if result.outcome is Outcome.APPLIED and result.task_id and result.task_version:
            # Replaced by the database's own time of the event (see _latency).
            committed[(str(result.task_id), result.task_version)] = time.time()

    start = time.perf_counter()
    for i in range(total):
        due = start + i / opts.rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lag.append(-delay * 1000)
        jobs.append(asyncio.create_task(apply(i)))
    await asyncio.gather(*jobs)
    return total, lag


async def _delete_streams(cfg: BusConfig) -> None:
    import nats
    import nats.js.errors

    nc = await nats.connect(cfg.url)
    try:
        js = nc.jetstream()
        for name in (cfg.stream, f"{cfg.stream}_DLQ"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()
