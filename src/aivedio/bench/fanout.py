"""``aivedio bench fanout``: one project's events to many SSE clients of one gateway process.

Setup as in ``bench connections`` (gateway in its own process, scratch database, private Redis
channel); ``clients`` connections from ``procs`` client processes to ONE project. Every event
takes the real path: ``StateService.apply`` writes it (task row, task event, outbox row) in
PostgreSQL, then the driver publishes to Redis exactly what the dispatcher publishes for that
outbox row (``parse_event`` + ``routed_message``), stamping ``time.time()`` just before PUBLISH.
The payload stays whitelisted: latency is matched by seq (the SSE ``id:``), never by a payload
field. Latency per (client, event) = the client's receive time - the publish time (one machine,
one clock).

(a) **latency**: ``events`` events, ``gap_s`` apart; P50/P99 over every (client, event).
(b) **sustained**: ``steps`` rounds of ``step_s`` seconds at rates ``rate / 2^(steps-1)`` ..
    ``rate`` events/s, ``pause_s`` between rounds. Per round: delivered frames / (last receive -
    first publish); ``frames_per_s`` is the best round (the gateway's written frames per second,
    whether it kept up or fell behind), with the gateway's CPU per round.
Every client must receive every event exactly once (``missing``/``duplicate`` frames are printed).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis.asyncio as aioredis

from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    percentile,
    print_json_line,
    rounded,
)
from aivedio.bench.sse_load import FDS_PER_PROCESS, Report, Target, fleet, gateway_under_test
from aivedio.config import DatabaseConfig, Settings, StateConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.propagation.dispatcher import parse_event, routed_message
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore

__all__ = ["run"]

TARGET_P99_MS = 250.0
TARGET_FRAMES_PER_S = 50_000.0
PROGRESS_PER_TASK = 95  # progress 1..95 by 1: one event each (coalescing is set to 1 point)

OUTBOX_PAYLOAD = """
SELECT payload FROM outbox_events
WHERE aggregate_id = $1 AND aggregate_version = $2
"""


@dataclass(frozen=True, slots=True)
class Options:
    clients: int = 10_000
    procs: int = 4
    events: int = 20
    gap_s: float = 0.5
    rate: float = 20.0
    steps: int = 4
    step_s: float = 4.0
    pause_s: float = 3.0
    heartbeat_s: float = 20.0
    loop: str = "asyncio"  # the gateway process's event loop: asyncio or uvloop

    def check(self) -> None:
        if self.loop not in ("asyncio", "uvloop"):
            raise BenchUsageError("loop is asyncio or uvloop")
        if self.clients < 1 or self.procs < 1 or self.events < 0 or self.steps < 0:
            raise BenchUsageError("clients and procs >= 1, events and steps >= 0")
        if math.ceil(self.clients / self.procs) > FDS_PER_PROCESS:
            raise BenchUsageError(f"at most {FDS_PER_PROCESS} clients per process: raise procs")
        if self.clients > FDS_PER_PROCESS:
            raise BenchUsageError(f"one gateway process holds at most {FDS_PER_PROCESS}")
        if self.rate <= 0 or self.step_s <= 0 or self.gap_s < 0 or self.pause_s < 0:
            raise BenchUsageError("rate and step_s > 0; gap_s and pause_s >= 0")

    def rates(self) -> list[float]:
        return [self.rate / 2 ** (self.steps - 1 - i) for i in range(self.steps)]

    def total_events(self) -> int:
        return self.events + sum(math.ceil(r * self.step_s) for r in self.rates())


@dataclass(slots=True)
class Publisher:
    """Applies observations through the state service and publishes the dispatcher's message."""

    state: StateService
    db: Database
    redis: aioredis.Redis
    channel: str
    attempts: list[uuid.UUID]
    published: dict[int, float] = field(default_factory=dict)  # seq -> publish time
    next_task: int = 0
    progress: dict[int, int] = field(default_factory=dict)

    async def one(self) -> int:
        k = self.next_task // PROGRESS_PER_TASK
        self.next_task += 1
        step = self.progress.get(k, 0) + 1
        self.progress[k] = step
        obs = ProviderObservation(
            provider="sandbox",
            attempt_id=self.attempts[k],
            status=ProviderStatus.RUNNING,
            source=Source.POLL,
            provider_sequence=step,
            provider_occurred_at=datetime.now(UTC),
            progress=step,
        )
        result = await self.state.apply(obs)
        if result.outcome is not Outcome.APPLIED or result.event is None:
            raise RuntimeError(f"observation not applied: {result.outcome} {result.reason}")
        async with self.db.connection() as conn:
            payload = await conn.fetchval(OUTBOX_PAYLOAD, result.task_id, result.task_version)
        raw = payload if isinstance(payload, str | bytes) else json.dumps(payload)
        event = parse_event(raw.encode() if isinstance(raw, str) else raw)
        assert event is not None
        assert event.seq == result.event.seq
        message = routed_message(event)
        self.published[event.seq] = time.time()
        await self.redis.publish(self.channel, message)
        return event.seq


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


async def _run(settings: Settings, opts: Options) -> int:
    rates = ", ".join(f"{r:g}" for r in opts.rates())
    print(
        f"fanout: {opts.clients} SSE clients ({opts.procs} processes) on one project of one "
        f"gateway process; {opts.events} events {opts.gap_s:g} s apart, then {rates} events/s "
        f"for {opts.step_s:g} s each",
        flush=True,
    )
    figures: dict[str, Any] = {"bench": "fanout", "gateway_loop": opts.loop}
    async with gateway_under_test(settings, opts.heartbeat_s, opts.loop) as target:
        print(f"  gateway: pid {target.gateway.pid}, port {target.gateway.port}", flush=True)
        db = await Database.connect(
            DatabaseConfig(url=target.database_url, min_size=1, max_size=4, acquire_timeout_s=30)
        )
        redis = aioredis.Redis.from_url(target.redis_url)
        try:
            state = StateService(db, StateConfig(1, timedelta(0)))
            attempts = await _make_tasks(db, state, target, opts)
            publisher = Publisher(state, db, redis, target.channel, attempts)
            async with fleet(target, opts.clients, opts.procs, record_events=True) as clients:
                ready = await clients.connect()
                print(
                    f"  connected {ready.established} of {opts.clients} in {ready.seconds:.1f} s "
                    f"({ready.failed} failed)",
                    flush=True,
                )
                await asyncio.sleep(1.0)
                latency_seqs = await _latency_phase(publisher, opts)
                rounds = await _sustained_phase(publisher, target, opts)
                await asyncio.sleep(max(1.0, opts.pause_s))  # the clients read the last bytes
                report = await clients.stop()
        finally:
            await redis.aclose()
            await db.close()
    figures |= {
        "clients": ready.established,
        "failed": ready.failed,
        "procs": opts.procs,
        "events": len(latency_seqs),
    }
    figures |= _delivery(report, publisher.published, ready.established)
    figures["client_cpu_s"] = rounded(report.cpu_s, 2)
    figures["ok"] = (
        ready.established == opts.clients
        and figures["missing_frames"] == 0
        and figures["duplicate_frames"] == 0
    )
    _summarize(figures, report, publisher.published, latency_seqs, rounds)
    print_json_line(figures)
    return 0 if figures["ok"] else 1


async def _make_tasks(
    db: Database, state: StateService, target: Target, opts: Options
) -> list[uuid.UUID]:
    """Enough tasks for every event (one progress point per event), created before any client
    connects (their creation events are then behind every client's start)."""
    store = TaskStore(db, state, timedelta(hours=1))
    principal = Principal(target.tenant_id, target.user_id)
    body = NewTask(provider="sandbox", model="bench", prompt="a fox in the snow", params={})
    attempts: list[uuid.UUID] = []
    for _ in range(opts.total_events() // PROGRESS_PER_TASK + 1):
        created = await store.create(principal, target.project_id, uuid.uuid4().hex, body, None)
        async with db.connection() as conn:
            attempt: uuid.UUID = await conn.fetchval(
                "SELECT current_attempt_id FROM generation_tasks WHERE id = $1",
                uuid.UUID(created.snapshot["id"]),
            )
        attempts.append(attempt)
    return attempts


async def _latency_phase(publisher: Publisher, opts: Options) -> list[int]:
    seqs = []
    for _ in range(opts.events):
        seqs.append(await publisher.one())
        await asyncio.sleep(opts.gap_s)
    return seqs


@dataclass(frozen=True, slots=True)
class Round:
    rate: float
    seqs: list[int]
    seconds: float  # from the first publish to the last
    gateway_cpu_s: float  # from the first publish until the gateway is idle again


async def _sustained_phase(publisher: Publisher, target: Target, opts: Options) -> list[Round]:
    rounds = []
    for rate in opts.rates():
        await asyncio.sleep(opts.pause_s)
        cpu = target.gateway.cpu_s()
        count = math.ceil(rate * opts.step_s)
        seqs = []
        start = time.perf_counter()
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            seqs.append(await publisher.one())
        seconds = time.perf_counter() - start
        await target.gateway.wait_idle()  # this round's backlog is written
        rounds.append(Round(rate, seqs, seconds, target.gateway.cpu_s() - cpu))
    return rounds


def _delivery(report: Report, published: dict[int, float], clients: int) -> dict[str, Any]:
    missing = sum(max(0, clients - len(report.events.get(seq, ()))) for seq in published)
    duplicates = sum(max(0, len(report.events.get(seq, ())) - clients) for seq in published)
    unexpected = sum(len(t) for seq, t in report.events.items() if seq not in published)
    return {
        "missing_frames": missing,
        "duplicate_frames": duplicates,
        "unexpected_frames": unexpected,
        "closed_by_server": report.lost,
        "resets": report.resets,
    }


def _summarize(
    figures: dict[str, Any],
    report: Report,
    published: dict[int, float],
    latency_seqs: list[int],
    rounds: list[Round],
) -> None:
    """Print the figures of both phases and add them to ``figures``."""
    clients = figures["clients"]
    lat = _latencies(report, published, latency_seqs)
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    per_event_last = [
        (max(report.events[s]) - published[s]) * 1000 for s in latency_seqs if report.events.get(s)
    ]
    print(
        f"  one event to {clients} clients: P50 {p50:.1f} ms, P99 {p99:.1f} ms, max "
        f"{max(lat, default=math.nan):.1f} ms over {len(lat)} (client, event) pairs; last client "
        f"reached after {percentile(per_event_last, 50):.1f} ms (median event), "
        f"{max(per_event_last, default=math.nan):.1f} ms (worst event) (target P99 <= "
        f"{TARGET_P99_MS:g} ms: {'met' if p99 <= TARGET_P99_MS else 'NOT met'})",
        flush=True,
    )
    best = 0.0
    table = []
    for r in rounds:
        fps, row = _round(r, report, published, clients)
        best = max(best, fps)
        table.append(row)
    print(
        f"  sustained: {best:,.0f} frames/s written by one gateway process (target >= "
        f"{TARGET_FRAMES_PER_S:,.0f}: {'met' if best >= TARGET_FRAMES_PER_S else 'NOT met'}); "
        f"missing frames {figures['missing_frames']}, duplicates {figures['duplicate_frames']}, "
        f"closed by the server {report.lost} {dict(report.closes)}; client CPU "
        f"{report.cpu_s:.1f} s",
        flush=True,
    )
    figures |= {
        "p50_ms": rounded(p50, 2),
        "p99_ms": rounded(p99, 2),
        "max_ms": rounded(max(lat, default=math.nan), 2),
        "last_client_p50_ms": rounded(percentile(per_event_last, 50), 1),
        "target_p99_ms": TARGET_P99_MS,
        "frames_per_s": rounded(best, 0),
        "target_frames_per_s": TARGET_FRAMES_PER_S,
        "rounds": table,
    }


def _round(
    r: Round, report: Report, published: dict[int, float], clients: int
) -> tuple[float, dict[str, Any]]:
    """Print one round of the throughput phase; its frames per second and its row."""
    frames = sum(len(report.events.get(s, ())) for s in r.seqs)
    last = max((max(report.events[s]) for s in r.seqs if report.events.get(s)), default=0.0)
    first = published[r.seqs[0]] if r.seqs else 0.0
    span = last - first if last > first else math.nan
    fps = frames / span if span > 0 else 0.0
    rl = _latencies(report, published, r.seqs)
    cpu_pct = r.gateway_cpu_s / span * 100 if span > 0 else math.nan
    kept_up = span <= r.seconds + 1.0
    print(
        f"  {r.rate:g} events/s offered ({r.rate * clients:,.0f} frames/s): published "
        f"{len(r.seqs)} in {r.seconds:.2f} s, delivered {frames:,} frames in {span:.2f} s = "
        f"{fps:,.0f} frames/s; P50 {percentile(rl, 50):.1f} ms P99 {percentile(rl, 99):.1f} "
        f"ms; gateway CPU {r.gateway_cpu_s:.2f} s ({cpu_pct:.0f} % of one core over the "
        f"delivery span){'' if kept_up else '; fell behind'}",
        flush=True,
    )
    return fps, {
        "rate": r.rate,
        "offered_frames_per_s": rounded(r.rate * clients, 0),
        "frames_per_s": rounded(fps, 0),
        "p99_ms": rounded(percentile(rl, 99), 1),
        "gateway_cpu_s": rounded(r.gateway_cpu_s, 2),
        "kept_up": kept_up,
    }


def _latencies(report: Report, published: dict[int, float], seqs: list[int]) -> list[float]:
    out: list[float] = []
    for seq in seqs:
        at = published[seq]
        out.extend((t - at) * 1000 for t in report.events.get(seq, ()))
    return out
