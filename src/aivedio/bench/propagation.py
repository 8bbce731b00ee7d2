"""``aivedio bench propagation``: outbox -> relay -> JetStream -> dispatcher -> Redis Pub/Sub.

In a scratch database and a private JetStream stream (both removed at the end), with a Redis
subscriber in this process counting every event on a private channel:

(a) **drain**: ``events`` outbox rows (``tasks`` tasks, their versions interleaved, payloads shaped
    like the state service's) are inserted with SQL, then ``relays`` relays and one dispatcher
    start (in child processes, as separate roles would run) and the clock runs until the
    subscriber has every (task, version); ``per_s`` = events / seconds. Every event is accounted
    for: missing, duplicate and out-of-order counts are printed and must be 0.
(b) **latency**: ``rate`` observations/s for ``seconds`` through ``StateService.apply_in`` (or
    ``apply_many_in`` of ``writer_batch`` observations per commit) on ``latency_tasks`` tasks in
    ``projects`` projects, from ``writers`` processes, each writer owning the transaction so it
    can stamp both ends of its ``COMMIT``. Latency = the subscriber's receive time (after the
    Redis publish) minus the moment ``COMMIT`` returned in the writer (``p50_ms``, ``p99_ms``):
    the commit happened just before that reply, so this is the issue's "commit -> publish" up to
    the reply's trip and the writer's wake-up. The same from the moment ``COMMIT`` was sent
    (``p50_ms_upper``, ``p99_ms_upper``) is an upper bound: it adds the writer's WAL flush and
    wait for its turn in the group commit, which no part of the propagation path can shorten.
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
from urllib.parse import urlsplit

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
from aivedio.config import DatabaseConfig, Settings, StateConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
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
    workers: int = 32  # concurrent applies in the latency phase, split over the writers
    writers: int = 4  # writer processes in the latency phase
    writer_batch: int = 1
    """Observations per transaction in the latency phase: 1 = ``StateService.apply_in`` each (one
    commit per event); N > 1 = ``apply_many_in`` of N every N intervals (the inbox processor's and
    poller's batching), which costs the writers far less CPU for the same steady event rate."""
    probe: int = 100  # single events, one at a time, before the steady load
    latency_relays: int = 1  # relay processes in the latency phase
    timeout: float = 120.0

    def check(self) -> None:
        for name in (
            "tasks",
            "relays",
            "batch",
            "in_flight",
            "latency_tasks",
            "projects",
            "writers",
            "writer_batch",
        ):
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
        url=urls.redis_url if settings.bus == "redis-streams" else urls.nats_url,
        adapter=settings.bus,
        stream=f"BENCH_{tag}",
        subject_prefix=f"bench{tag}",
        max_in_flight=opts.in_flight,
        max_ack_pending=20_000,
    )
    prefix = f"bench{tag}"
    print(
        f"propagation: drain {opts.events} outbox rows ({opts.tasks} tasks), {opts.relays} "
        f"relay(s) + 1 dispatcher in child processes; then {opts.rate} events/s for "
        f"{opts.seconds:g} s through StateService."
        + (
            "apply_in"
            if opts.writer_batch == 1
            else f"apply_many_in ({opts.writer_batch} per commit)"
        ),
        flush=True,
    )
    figures: dict[str, Any] = {"bench": "propagation"}
    async with scratch_database(database_url(settings)) as url:
        counted = Counted()
        reader = await _subscribe(urls.redis_url, broadcast_channel(prefix), counted)
        try:
            figures |= await _drain(url, bus_cfg, urls.redis_url, prefix, opts, counted)
            figures |= await _latency(settings, url, bus_cfg, urls.redis_url, prefix, opts, counted)
        finally:
            reader.close()
            await _delete_streams(bus_cfg)
    figures["ok"] = all(
        figures.get(k, 0) == 0 for k in ("missing", "duplicates_at_subscriber", "latency_missing")
    )
    print_json_line(figures)
    return 0 if figures["ok"] else 1


# -- the subscriber --------------------------------------------------------------------------


class _Subscriber(asyncio.Protocol):
    """A bare RESP2 Pub/Sub reader: the measuring instrument must cost less than the pipeline
    it measures. redis-py's ``PubSub.get_message`` parses each frame in Python at ~250 us of CPU
    per event (py-spy, drain phase): more than the relays and the dispatcher together, on the
    same 2 cores. A gateway node subscribes in its own process; this one shares the machine."""

    PREFIX = b"*3\r\n$7\r\nmessage\r\n$"

    def __init__(self, counted: Counted) -> None:
        self.counted = counted
        self.buffer = bytearray()
        self.subscribed = asyncio.Event()
        self.closed = asyncio.Event()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        if not self.subscribed.is_set():
            # *3 $9 subscribe $n <channel> :1 -- the confirmation ends with the count.
            end = buf.find(b":1\r\n")
            if end < 0:
                return
            del buf[: end + 4]
            self.subscribed.set()
        now = time.time()
        pos = 0
        prefix, size = self.PREFIX, len(self.PREFIX)
        while buf.startswith(prefix, pos):
            head = pos + size
            eol = buf.find(b"\r\n", head)
            if eol < 0:
                break
            data_head = eol + 2 + int(buf[head:eol]) + 3  # past the channel, its CRLF and "$"
            eol = buf.find(b"\r\n", data_head)
            if eol < 0:
                break
            start = eol + 2
            stop = start + int(buf[data_head:eol])
            if len(buf) < stop + 2:
                break
            self._count(json.loads(buf[start:stop]), now)
            pos = stop + 2
        if pos:
            del buf[:pos]

    def _count(self, body: dict[str, Any], now: float) -> None:
        counted = self.counted
        key = (body["task_id"], body["task_version"])
        if key in counted.first:
            counted.duplicates += 1
            return
        counted.first[key] = now
        if key[1] <= counted.last_version.get(key[0], 0):
            counted.out_of_order += 1
        counted.last_version[key[0]] = key[1]


async def _subscribe(redis_url: str, channel: str, counted: Counted) -> asyncio.Transport:
    where = urlsplit(redis_url)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: _Subscriber(counted), where.hostname or "127.0.0.1", where.port or 6379
    )
    name = channel.encode()
    if where.password:
        secret = where.password.encode()
        transport.write(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
    transport.write(b"*2\r\n$9\r\nSUBSCRIBE\r\n$%d\r\n%s\r\n" % (len(name), name))
    await asyncio.wait_for(protocol.subscribed.wait(), 10)
    return transport


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


def _child(spec: ChildSpec, ready: Any, go: Any, stop: Any, cpu: Any) -> None:
    """One pipeline process, on uvloop like ``aivedio run``; reports its CPU seconds."""
    import uvloop

    uvloop.run(_child_main(spec, ready, go, stop, cpu))


async def _child_main(spec: ChildSpec, ready: Any, go: Any, stop: Any, cpu: Any) -> None:
    from aivedio.bus.connect import connect

    db = await Database.connect(
        DatabaseConfig(url=spec.database_url, min_size=1, max_size=spec.relays + 2)
    )
    bus = await connect(spec.bus)
    fanout = RedisFanout.from_url(spec.redis_url)
    stopping = asyncio.Event()
    relay_cfg = RelayConfig(batch_size=spec.batch, stats_interval_s=3600)
    dispatch_cfg = DispatcherConfig(channel_prefix=spec.prefix, batch_size=spec.batch)
    loops = [OutboxRelay(db, bus, relay_cfg).run for _ in range(spec.relays)]
    loops += [
        NotificationDispatcher(bus, fanout, dispatch_cfg).run for _ in range(spec.dispatchers)
    ]
    ready.set()
    # Nobody starts before everybody is connected: the clock starts at ``go``, so a relay that
    # came up first cannot drain part of the backlog off the clock.
    while not go.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.001)
    jobs = [asyncio.create_task(loop(stopping)) for loop in loops]
    started = time.process_time()
    while not stop.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.05)
    cpu.value = time.process_time() - started  # the work, not the start-up and the shutdown
    stopping.set()
    await asyncio.gather(*jobs, return_exceptions=True)
    await fanout.close()
    await bus.close()
    await db.close()


@contextlib.asynccontextmanager
async def _pipeline(specs: list[ChildSpec], cpu: dict[str, float] | None = None) -> Any:
    """Run the children for the block; ``cpu`` gets their CPU seconds by role once they end."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    go = ctx.Event()
    children = []
    used = []
    for spec in specs:
        ready = ctx.Event()
        seconds = ctx.Value("d", 0.0)
        proc = ctx.Process(target=_child, args=(spec, ready, go, stop, seconds), daemon=True)
        proc.start()
        children.append((proc, ready))
        used.append(("relay" if spec.relays else "dispatcher", seconds))
    try:
        for proc, ready in children:
            while not ready.is_set():
                if not proc.is_alive():
                    raise RuntimeError("a pipeline process failed to start")
                await asyncio.sleep(0.02)
        go.set()
        yield
    finally:
        stop.set()
        for proc, _ in children:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
        if cpu is not None:
            for role, seconds in used:
                cpu[role] = cpu.get(role, 0.0) + seconds.value


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
        cpu: dict[str, float] = {}
        async with _pipeline(_specs(url, bus, redis_url, prefix, opts), cpu):
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
    print(f"  drain CPU: {_cpu_line(cpu, got)}", flush=True)
    return {
        "per_s": rounded(per_s, 1),
        "events": total,
        "missing": total - got,
        "duplicates_at_subscriber": counted.duplicates,
        "out_of_order": counted.out_of_order,
        "drain_seconds": rounded(seconds),
        "relays": opts.relays,
        "drain_cpu_us_per_event": {k: rounded(v / max(got, 1) * 1e6, 1) for k, v in cpu.items()},
    }


def _cpu_line(cpu: dict[str, float], events: int) -> str:
    """CPU per event by role: comparable across runs on a busy machine, unlike wall time."""
    return ", ".join(
        f"{role} {seconds:.2f} s ({seconds / max(events, 1) * 1e6:.0f} us/event)"
        for role, seconds in sorted(cpu.items())
    )


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
        DatabaseConfig(url=url, min_size=4, max_size=min(16, opts.workers), acquire_timeout_s=30)
    )
    try:
        state = StateService(db, settings.state)
        attempts = await _make_tasks(db, state, opts)
        acked: dict[tuple[str, int], tuple[float, float]] = {}  # (COMMIT sent, returned)
        cpu: dict[str, float] = {}
        async with _pipeline(
            _specs(url, bus, redis_url, prefix, replace(opts, relays=opts.latency_relays)), cpu
        ):
            await asyncio.sleep(1.0)  # the creations' events drain first
            single = await _probe(url, counted, opts.probe)
            given, lag, seconds = await _writers(url, settings, attempts, opts, acked, cpu)
            deadline = time.perf_counter() + 10
            while not set(acked) <= set(counted.first) and time.perf_counter() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # Where the time goes: the relay round that published the event started at
        # published_at (its transaction's now(); this machine's clock, like the stamps).
        async with db.connection() as conn:
            picked = await conn.fetch(
                "SELECT aggregate_id::text AS task_id, aggregate_version AS task_version,"
                " extract(epoch FROM published_at)::float8 AS at"
                " FROM outbox_events WHERE published_at IS NOT NULL"
            )
    finally:
        await db.close()
    received = [(k, sent, done) for k, (sent, done) in acked.items() if k in counted.first]
    latencies = [(counted.first[k] - done) * 1000 for k, _, done in received]
    upper = [(counted.first[k] - sent) * 1000 for k, sent, _ in received]
    flush = [(done - sent) * 1000 for _, sent, done in received]
    lost = len(acked) - len(received)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    print(
        f"  latency: commit (COMMIT returned in the writer) -> Redis subscriber "
        f"p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {max(latencies, default=0):.2f} ms  "
        f"({len(acked)} events at {len(acked) / seconds:,.0f}/s asked {opts.rate}/s by "
        f"{opts.writers} writer processes, {given} observations, {lost} not received; writers' "
        f"scheduler lag p99 {percentile(lag, 99):.1f} ms)",
        flush=True,
    )
    round_start = {(r["task_id"], r["task_version"]): r["at"] for r in picked}
    to_round = [(round_start[k] - done) * 1000 for k, _, done in received if k in round_start]
    print(
        f"  upper bound, from COMMIT sent: p50 {percentile(upper, 50):.2f} ms  "
        f"p99 {percentile(upper, 99):.2f} ms (the writer's COMMIT itself took p50 "
        f"{percentile(flush, 50):.2f} ms  p99 {percentile(flush, 99):.2f} ms); where: commit -> "
        f"start of the relay round that published it p50 {percentile(to_round, 50):.2f} ms  "
        f"p99 {percentile(to_round, 99):.2f} ms",
        flush=True,
    )
    if single:
        print(
            f"  single events (one at a time, every 20 ms): commit -> Redis subscriber "
            f"p50 {percentile(single, 50):.2f} ms  p90 {percentile(single, 90):.2f} ms  "
            f"p99 {percentile(single, 99):.2f} ms",
            flush=True,
        )
    print(f"  latency CPU (whole phase): {_cpu_line(cpu, len(acked))}", flush=True)
    return {
        "p50_ms": rounded(p50),
        "p99_ms": rounded(p99),
        "p50_ms_upper": rounded(percentile(upper, 50)),
        "p99_ms_upper": rounded(percentile(upper, 99)),
        "latency_events": len(acked),
        "latency_rate_per_s": rounded(len(acked) / seconds, 1),
        "latency_missing": lost,
        "latency_writers": opts.writers,
        "single_p50_ms": rounded(percentile(single, 50)) if single else None,
        "single_p99_ms": rounded(percentile(single, 99)) if single else None,
        "latency_cpu_us_per_event": {
            k: rounded(v / max(len(acked), 1) * 1e6, 1) for k, v in cpu.items()
        },
    }


ONE = """
INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type, payload)
VALUES ('task', $1, $2::int, 'task.status.changed', jsonb_build_object(
    'event_type', 'task.status.changed', 'aggregate_id', $1::uuid, 'aggregate_version', $2::int,
    'project_id', $1::uuid, 'epoch', 1, 'event_id', $2::int, 'status', 'running',
    'public', jsonb_build_object('task_id', $1::uuid, 'task_version', $2::int,
                                 'status', 'generating', 'progress', $2::int)))
"""


async def _probe(url: str, counted: Counted, n: int) -> list[float]:
    """The path's own latency: ``n`` outbox rows committed one at a time (20 ms apart), each
    timed from its COMMIT returning in this otherwise idle process to the subscriber."""
    if n <= 0:
        return []
    conn = await asyncpg.connect(url)
    out: list[float] = []
    try:
        task = uuid.uuid4()
        for version in range(1, n + 1):
            await conn.execute(ONE, task, version)
            committed = time.time()
            key = (str(task), version)
            deadline = committed + 5
            while key not in counted.first and time.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.0002)
            if key in counted.first:
                out.append((counted.first[key] - committed) * 1000)
            await asyncio.sleep(0.02)
    finally:
        await conn.close()
    return out


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


@dataclass(frozen=True, slots=True)
class WriterSpec:
    database_url: str
    state: StateConfig
    attempts: list[uuid.UUID]  # this writer's tasks (each task has one writer: its order holds)
    total: int  # observations to apply
    interval: float  # seconds between this writer's starts
    offset: float  # its first start after the common start time
    workers: int  # concurrent applies (its pool size)
    batch: int = 1  # observations per transaction


async def _writers(
    url: str,
    settings: Settings,
    attempts: list[uuid.UUID],
    opts: Options,
    acked: dict[tuple[str, int], tuple[float, float]],
    cpu: dict[str, float],
) -> tuple[int, list[float], float]:
    """``opts.rate`` applies/s for ``opts.seconds`` from ``opts.writers`` processes (one process
    could not offer 1,000/s: StateService.apply costs ~0.7 ms of CPU), interleaved in time."""
    n = min(opts.writers, len(attempts))
    total = int(opts.rate * opts.seconds)
    specs = [
        WriterSpec(
            database_url=url,
            state=settings.state,
            attempts=attempts[w::n],
            total=total // n + (w < total % n),
            interval=n / opts.rate,
            offset=w / opts.rate,
            workers=max(2, opts.workers // n),
            batch=opts.writer_batch,
        )
        for w in range(n)
    ]
    ctx = multiprocessing.get_context("spawn")
    start_at = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = []
    readies = []
    for spec in specs:
        ready = ctx.Event()
        proc = ctx.Process(target=_writer, args=(spec, ready, start_at, results), daemon=True)
        proc.start()
        procs.append(proc)
        readies.append(ready)
    try:
        for proc, ready in zip(procs, readies, strict=True):
            while not ready.is_set():
                if not proc.is_alive():
                    raise RuntimeError("a writer process failed to start")
                await asyncio.sleep(0.02)
        start_at.value = time.time() + 0.2
        lag: list[float] = []
        ended = 0.0
        for _ in procs:
            keys, lags, seconds, end = await asyncio.to_thread(
                results.get, True, opts.seconds + 120
            )
            ended = max(ended, end)
            acked.update(keys)
            lag += lags
            cpu["writers"] = cpu.get("writers", 0.0) + seconds
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
    return total, lag, ended - start_at.value


def _writer(spec: WriterSpec, ready: Any, start_at: Any, results: Any) -> None:
    import uvloop

    results.put(uvloop.run(_writer_main(spec, ready, start_at)))


Stamped = tuple[tuple[str, int], tuple[float, float]]  # (task, version), (COMMIT sent, returned)


async def _writer_main(
    spec: WriterSpec, ready: Any, start_at: Any
) -> tuple[list[Stamped], list[float], float, float]:
    db = await Database.connect(
        DatabaseConfig(
            url=spec.database_url,
            min_size=spec.workers,
            max_size=spec.workers,
            acquire_timeout_s=30,
        )
    )
    try:
        state = StateService(db, spec.state)
        ready.set()
        while not start_at.value:  # noqa: ASYNC110 - a multiprocessing value
            await asyncio.sleep(0.005)
        cpu = time.process_time()
        committed, lag = await _steady(state, spec, start_at.value)
        return committed, lag, time.process_time() - cpu, time.time()
    finally:
        await db.close()


async def _steady(
    state: StateService, spec: WriterSpec, start_at: float
) -> tuple[list[Stamped], list[float]]:
    """Start ``spec.total`` applies, one every ``spec.interval`` s (round robin over its tasks);
    each transaction is the writer's own, so both ends of its COMMIT are stamped."""
    step = max(1, state.policy.min_points)
    attempts = spec.attempts
    progress = [0] * len(attempts)
    sequence = [0] * len(attempts)
    sem = asyncio.Semaphore(spec.workers)
    lag: list[float] = []
    committed: list[Stamped] = []
    jobs: list[asyncio.Task[None]] = []

    def observation(i: int) -> ProviderObservation:
        k = i % len(attempts)
        progress[k] = min(99, progress[k] + step)
        sequence[k] += 1
        return ProviderObservation(
            provider="sandbox",
            attempt_id=attempts[k],
            status=ProviderStatus.RUNNING,
            source=Source.POLL,
            provider_sequence=sequence[k],
            provider_occurred_at=datetime.now(UTC),
            progress=progress[k],
        )

    async def apply(first_i: int, count: int) -> None:
        batch = [observation(i) for i in range(first_i, first_i + count)]
        async with sem:
            async with state.db.transaction() as conn:
                if len(batch) == 1:
                    results = [await state.apply_in(conn, batch[0])]
                else:
                    results = await state.apply_many_in(conn, batch)
                sent = time.time()
            done = time.time()
        for result in results:
            if result.outcome is Outcome.APPLIED and result.task_id and result.task_version:
                committed.append(((str(result.task_id), result.task_version), (sent, done)))

    first = start_at + spec.offset
    size = max(1, spec.batch)
    for i in range(0, spec.total, size):
        # A batch leaves when its last observation is due: none is applied before its time.
        count = min(size, spec.total - i)
        delay = first + (i + count - 1) * spec.interval - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lag.append(-delay * 1000)
        jobs.append(asyncio.create_task(apply(i, count)))
    await asyncio.gather(*jobs)
    return committed, lag


async def _delete_streams(cfg: BusConfig) -> None:
    if cfg.adapter == "redis-streams":
        client = aioredis.Redis.from_url(cfg.url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            keys = [k async for k in client.scan_iter(match=f"{cfg.subject_prefix}:*", count=500)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
        return
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
