"""``bench e2e``: one scenario (a task table, its SSE streams) through the ramp, step by step.

A step: the clients are told which (task, progress) pairs to expect, the load generator builds
and signs the step's webhooks, CPU is snapshotted, the webhooks go out open loop, and the step
ends when every expected frame was read, or nothing arrived for ``quiet_s`` after the last send,
or ``settle_s`` passed. Then the chain must drain (inbox and outbox empty) before the next rate.
Latency counts from each webhook's due time to its frame's read time; where the time went comes
from the stamps the chain carries (see ``e2e_schedule.STAGES``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import asyncpg
import httpx

from aivedio.bench import pg_statements
from aivedio.bench.common import percentile
from aivedio.bench.e2e_clients import ClientsProcess, Frames, Stream
from aivedio.bench.e2e_deploy import CpuMeter, chain_backlog
from aivedio.bench.e2e_load import Generation, LoadProcess, LoadResult
from aivedio.bench.e2e_schedule import (
    STAGES,
    Cursor,
    RateResult,
    Step,
    build_step,
    stage_samples,
    summary_ms,
)
from aivedio.bench.pg_statements import StatementFigures

_STARTED = time.monotonic()


def say(text: str) -> None:
    """A progress line, with the seconds since the bench started."""
    print(f"[{time.monotonic() - _STARTED:7.1f} s] {text}", flush=True)


@dataclass
class Target:
    """What a scenario runs against: aivedio (``db`` set: stamps and backlog from PostgreSQL)
    or the naive reference."""

    port: int
    table: list[Generation]
    task_ids: list[str]
    streams: list[Stream]
    meter: CpuMeter
    secrets: list[str]
    db: asyncpg.Connection | None = None
    sandbox: str | None = None  # the sandbox's base URL and API key, for its query counter
    sandbox_key: str = ""


@dataclass(frozen=True, slots=True)
class Knobs:
    duration_s: float
    points: int
    connections: int
    settle_s: float
    quiet_s: float
    stop_p99_ms: float
    stop_from: float  # the ramp may stop early only from this rate on
    idle_s: float  # the idle CPU is measured over this long before the ramp


@dataclass
class StepFigures:
    asked: float
    achieved: float = 0.0
    sent: int = 0
    accepted: int = 0  # answered 204
    arrived: int = 0
    lost: int = 0
    superseded: int = 0  # lost, but a later webhook of the same task arrived
    duplicates: int = 0
    latency: dict[str, float] = field(default_factory=dict)
    sender_lag_p99_ms: float = math.nan
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    untimed: int = 0  # frames without the gateway's timing line (replayed from PostgreSQL)
    cpu_s: dict[str, float] = field(default_factory=dict)
    polls: int = 0  # sandbox queries during the step (the poller)
    pg_write_xacts: int | None = None  # write transactions of the server: the step and its drain
    statements: list[StatementFigures] | None = None  # pg_stat_statements: the step and its drain
    window_s: float = 0.0  # from the step's start to its CPU snapshot (its last frame)
    ignored: dict[str, int] = field(default_factory=dict)  # webhooks audited, not applied
    refused: dict[int, int] = field(default_factory=dict)  # final answers that were not 204
    retried: int = 0  # webhooks sent again (non-2xx answer, connection closed before it)
    lost_where: dict[str, int] = field(default_factory=dict)  # how far a lost webhook got
    drained_s: float = 0.0
    drained: bool = True

    def superseded_note(self) -> str:
        """For the step's progress line: how many of the lost a later webhook of their task
        overtook (the state machine kept the later state: not lost on the way, not applied)."""
        if not self.superseded:
            return ""
        return f" ({self.superseded} superseded by a later one of their task)"

    def cpu_us(self) -> dict[str, float]:
        """CPU microseconds per webhook sent, per process group; ``aivedio`` sums the
        deployment's processes (``aivedio-<n>-<roles>``), ``postgres`` every backend of the
        run's database (``pg:<group>``: those serving that process), ``total`` every process."""
        per = {k: v / max(self.sent, 1) * 1e6 for k, v in self.cpu_s.items()}
        total = sum(per.values())
        for name, prefix in (("aivedio", "aivedio-"), ("postgres", "pg:")):
            parts = [v for k, v in per.items() if k.startswith(prefix)]
            if parts:
                per[name] = per.get(name, 0.0) + sum(parts)
        per["total"] = total
        return per

    def rate_result(self) -> RateResult:
        return RateResult(self.asked, self.achieved, self.latency.get("p99", math.nan), self.lost)


@dataclass
class ScenarioFigures:
    tasks: int
    projects: int
    streams: int
    min_gap_s: float
    idle_cores: dict[str, float] = field(default_factory=dict)
    steps: list[StepFigures] = field(default_factory=list)
    stopped: str | None = None


async def run_scenario(target: Target, rates: Sequence[float], knobs: Knobs) -> ScenarioFigures:
    clients, load = ClientsProcess(), LoadProcess()
    figures = ScenarioFigures(
        tasks=len(target.table),
        projects=len({s.project_id for s in target.streams}),
        streams=len(target.streams),
        min_gap_s=len(target.table) / max(rates),
    )
    try:
        await clients.start("127.0.0.1", target.port, target.streams)
        await load.start(target.port, target.secrets, target.table, knobs.connections)
        assert clients.pid is not None
        assert load.pid is not None
        target.meter.groups |= {"load": [load.pid], "clients": [clients.pid]}
        say(f"{len(target.streams)} SSE streams open; waiting for the chain to be idle")
        await _drain(target, clients, knobs.settle_s, knobs.quiet_s)
        before = await target.meter.snapshot()
        await asyncio.sleep(knobs.idle_s)
        idle = CpuMeter.seconds(before, await target.meter.snapshot())
        figures.idle_cores = {k: v / knobs.idle_s for k, v in idle.items()}
        cursor = Cursor.start(len(target.table))
        for rate in rates:
            step = build_step(cursor, rate, knobs.duration_s, knobs.points)
            result = await _step(target, clients, load, step, knobs)
            figures.steps.append(result)
            p99 = result.latency.get("p99", math.nan)
            say(
                f"{rate:7.0f}/s asked: {result.achieved:7.1f}/s, p50 "
                f"{result.latency.get('p50', math.nan):8.1f} ms, p99 {p99:8.1f} ms, lost "
                f"{result.lost}{result.superseded_note()}, drained in {result.drained_s:.1f} s"
            )
            if not result.drained:
                figures.stopped = f"the chain had not drained {knobs.settle_s:g} s after {rate:g}/s"
                break
            if rate >= knobs.stop_from and rate != rates[-1] and not p99 <= knobs.stop_p99_ms:
                figures.stopped = f"p99 {p99:.0f} ms at {rate:g}/s > stop_p99_ms"
                break
    finally:
        await load.stop()
        await clients.stop()
        target.meter.groups.pop("load", None)
        target.meter.groups.pop("clients", None)
    return figures


async def _drain(target: Target, clients: ClientsProcess, settle_s: float, quiet_s: float) -> bool:
    """Wait until the chain is empty and no frame came for a second (at most ``settle_s``)."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        status = await clients.status()
        empty = target.db is None or await chain_backlog(target.db) == (0, 0)
        if empty and time.time() - status.last_at > min(1.0, quiet_s):
            return True
        await asyncio.sleep(0.2)
    return False


async def _xacts(target: Target) -> int | None:
    """The server's next transaction id: the difference of two readings counts the write
    transactions (those that got an id) in between, at once and exactly, but of the whole server
    (other databases' writers too). ``pg_stat_database``'s counters would be the run's database
    only, but each backend reports them late (at most once a second while busy, 10 s after it
    went idle), so a step's count there took in its setup's and missed its own last seconds."""
    if target.db is None:
        return None
    value = await target.db.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
    return int(value)


async def _polls(target: Target) -> int:
    if target.sandbox is None:
        return 0
    async with httpx.AsyncClient(base_url=target.sandbox, timeout=5, trust_env=False) as c:
        auth = {"Authorization": f"Bearer {target.sandbox_key}"}
        stats = await c.get("/_sandbox/stats", headers=auth)
    return int(stats.json()["requests"].get("query", 0))


async def _step(
    target: Target, clients: ClientsProcess, load: LoadProcess, step: Step, knobs: Knobs
) -> StepFigures:
    pairs = zip(step.tasks, step.nth, strict=True)
    keys = [(target.task_ids[t], n * knobs.points) for t, n in pairs]
    await clients.expect(keys)
    await load.arm(step, knobs.points, knobs.settle_s)
    polls = await _polls(target)
    xacts = await _xacts(target)
    statements = None if target.db is None else await pg_statements.snapshot(target.db)
    before = await target.meter.snapshot()
    start = time.time() + 0.2
    sent = await load.go(start, knobs.duration_s + knobs.settle_s + 120)
    end_of_sends = start + knobs.duration_s
    while True:
        status = await clients.status()
        now = time.time()
        if status.arrived >= len(keys) or now > end_of_sends + knobs.settle_s:
            break
        if now > end_of_sends and now - max(status.last_at, end_of_sends) > knobs.quiet_s:
            break
        await asyncio.sleep(0.05)
    after = await target.meter.snapshot()
    figures = StepFigures(asked=step.rate, cpu_s=CpuMeter.seconds(before, after))
    figures.window_s = time.time() - start
    figures.polls = await _polls(target) - polls
    frames = await clients.collect()
    drain_started = time.monotonic()
    figures.drained = await _drain(target, clients, knobs.settle_s, knobs.quiet_s)
    figures.drained_s = time.monotonic() - drain_started
    after_xacts = await _xacts(target)
    if xacts is not None and after_xacts is not None:
        figures.pg_write_xacts = after_xacts - xacts
    if statements is not None and target.db is not None:
        after_statements = await pg_statements.snapshot(target.db)
        if after_statements is not None:
            figures.statements = pg_statements.between(statements, after_statements)
    frames = _merge(frames, await clients.collect())  # late ones still count as arrived
    await _figures(target, step, keys, sent, frames, figures, knobs.points)
    return figures


def _merge(a: Frames, b: Frames) -> Frames:
    for name in ("task_id", "progress", "version", "read", "relayed", "dispatched", "written"):
        getattr(a, name).extend(getattr(b, name))
    a.other += b.other
    return a


async def _figures(
    target: Target,
    step: Step,
    keys: list[tuple[str, int]],
    sent: LoadResult,
    frames: Frames,
    figures: StepFigures,
    points: int,
) -> None:
    first: dict[tuple[str, int], int] = {}
    highest: dict[str, int] = {}
    wanted = set(keys)
    for i, key in enumerate(zip(frames.task_id, frames.progress, strict=True)):
        if key not in wanted:
            continue
        if key in first:
            figures.duplicates += 1
        else:
            first[key] = i
        highest[key[0]] = max(highest.get(key[0], -1), key[1])
    figures.sent = sum(1 for w in sent.written if not math.isnan(w))
    figures.accepted = sum(1 for s in sent.status if s == 204)
    figures.retried = sent.retried
    for status in sent.status:
        if status != 204:
            figures.refused[status] = figures.refused.get(status, 0) + 1
    window = max(sent.written, default=0.0) - min(sent.written, default=0.0)
    figures.achieved = (figures.sent - 1) / window if window > 0 and figures.sent > 1 else 0.0
    figures.sender_lag_p99_ms = percentile(sent.lag_ms(), 99)
    latencies: list[float] = []
    hits: list[int | None] = []
    for i, key in enumerate(keys):
        at = first.get(key)
        hits.append(at)
        if at is None:
            figures.lost += 1
            figures.superseded += highest.get(key[0], -1) > key[1]
        else:
            latencies.append((frames.read[at] - sent.due[i]) * 1000)
    figures.arrived = len(latencies)
    figures.latency = summary_ms(latencies)
    if target.db is not None:
        await _stages(target, target.db, step, keys, sent, frames, hits, figures)


async def _stages(
    target: Target,
    db: asyncpg.Connection,
    step: Step,
    keys: list[tuple[str, int]],
    sent: LoadResult,
    frames: Frames,
    hits: list[int | None],
    figures: StepFigures,
) -> None:
    """Stamps per webhook from PostgreSQL (received, applied) and from its frame."""
    ids = [f"msg_{target.table[t].id}_{n + 1}" for t, n in zip(step.tasks, step.nth, strict=True)]
    received = {
        r["dedup_key"]: r["at"]
        for r in await db.fetch(
            "SELECT dedup_key, extract(epoch FROM received_at)::float8 AS at"
            " FROM provider_callback_inbox WHERE provider = 'sandbox'"
            " AND dedup_key = ANY($1::text[])",
            ids,
        )
    }
    tasks = sorted({k[0] for k in keys})
    applied = {
        (r["task_id"], r["progress"]): r["at"]
        for r in await db.fetch(
            "SELECT task_id::text AS task_id, (public_payload->>'progress')::int AS progress,"
            " extract(epoch FROM created_at)::float8 AS at FROM task_events"
            " WHERE task_id = ANY($1::uuid[]) AND created_at >= to_timestamp($2)",
            tasks,
            min(sent.due, default=time.time()) - 5,
        )
    }
    for i, at in enumerate(hits):
        if at is None:  # how far the lost one got
            where = (
                "refused"
                if sent.status[i] != 204
                else "not stored"
                if ids[i] not in received
                else "not applied"
                if keys[i] not in applied
                else "applied, no frame"
            )
            figures.lost_where[where] = figures.lost_where.get(where, 0) + 1
    figures.ignored = {
        r["reason"]: r["n"]
        for r in await db.fetch(
            "SELECT reason, count(*) AS n FROM observation_audit"
            " WHERE dedup_key = ANY($1::text[]) GROUP BY reason",
            ids,
        )
    }
    stamps = _stamps(ids, keys, sent, received, applied, frames, hits, figures)
    figures.stages = {k: summary_ms(v) for k, v in stage_samples(stamps).items()}


def _stamps(
    ids: list[str],
    keys: list[tuple[str, int]],
    sent: LoadResult,
    received: dict[str, float],
    applied: dict[tuple[str, int], float],
    frames: Frames,
    hits: list[int | None],
    figures: StepFigures,
) -> dict[str, list[float]]:
    """Each webhook's time at every stage (NaN where it did not get that far)."""
    nan = math.nan
    stamps: dict[str, list[float]] = {name: [] for name in ("sent", *STAGES)}
    for i, at in enumerate(hits):
        stamps["sent"].append(sent.written[i])
        stamps["received"].append(received.get(ids[i], nan))
        stamps["committed"].append(sent.answered[i])
        if at is None:
            for name in STAGES[2:]:
                stamps[name].append(nan)
            continue
        stamps["applied"].append(applied.get(keys[i], nan))
        stamps["relayed"].append(frames.relayed[at])
        stamps["dispatched"].append(frames.dispatched[at])
        stamps["written"].append(frames.written[at])
        stamps["read"].append(frames.read[at])
        figures.untimed += math.isnan(frames.written[at])
    return stamps
