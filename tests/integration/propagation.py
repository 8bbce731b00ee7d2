"""Helpers for the relay / dispatcher tests: a private bus namespace, a Redis subscriber, tasks
that move through many versions, and running relays and dispatchers as background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import nats
import nats.js.errors
import redis.asyncio as aioredis

from aivedio.bus import BusConfig
from aivedio.bus.jetstream import JetStreamBus
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.state.service import StateService
from tests.waiting import eventually


def bus_config(url: str, **overrides: Any) -> BusConfig:
    tag = uuid.uuid4().hex[:10]
    cfg = BusConfig(
        url=url,
        stream=f"TPROP_{tag}",
        subject_prefix=f"tprop{tag}",
        storage="memory",
        ack_wait_s=5.0,
        publish_timeout_s=2.0,
        reconnect_wait_s=0.2,
        connect_timeout_s=1.0,
    )
    return replace(cfg, **overrides)


async def delete_streams(url: str, cfg: BusConfig) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for name in (cfg.stream, f"{cfg.stream}_DLQ"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def private_bus(url: str, **overrides: Any) -> AsyncIterator[JetStreamBus]:
    """A JetStream bus on a stream of its own (``bus_config``); closed and its streams deleted
    afterwards."""
    cfg = bus_config(url, **overrides)
    bus = await JetStreamBus.connect(cfg)
    try:
        yield bus
    finally:
        await bus.close()
        await delete_streams(url, cfg)


async def stream_messages(url: str, cfg: BusConfig) -> list[tuple[str, bytes]]:
    """Every message of the main stream in stream order: (key header, data)."""
    nc = await nats.connect(url)
    out: list[tuple[str, bytes]] = []
    try:
        js = nc.jetstream()
        info = await js.stream_info(cfg.stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await js.get_msg(cfg.stream, seq)
                out.append(((msg.headers or {}).get("Aivedio-Key", ""), msg.data or b""))
    finally:
        await nc.close()
    return out


@dataclass
class Subscriber:
    """Counts every message on one Redis channel."""

    client: aioredis.Redis
    channel: str
    received: list[dict[str, Any]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        pubsub = self.client.pubsub()
        await pubsub.subscribe(self.channel)
        ready = asyncio.Event()

        async def read() -> None:
            try:
                ready.set()
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg["type"] == "message":
                        self.received.append(json.loads(msg["data"]))
            finally:
                await pubsub.aclose()

        self._task = asyncio.create_task(read())
        await ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def pairs(self) -> list[tuple[str, int]]:
        return [(m["task_id"], m["task_version"]) for m in self.received]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
        await eventually(
            predicate, lambda: f"the messages (received {len(self.received)})", timeout
        )


@contextlib.asynccontextmanager
async def running(*loops: Callable[[asyncio.Event], Awaitable[None]]) -> AsyncIterator[None]:
    """Run ``loop(stopping)`` coroutines in the background for the block; re-raise their errors."""
    stopping = asyncio.Event()
    tasks = [asyncio.create_task(loop(stopping)) for loop in loops]
    try:
        yield
    finally:
        stopping.set()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        errors = [d for d in done if isinstance(d, BaseException)]
        if errors:
            raise errors[0]


def progress(attempt_id: uuid.UUID, step: int) -> ProviderObservation:
    return ProviderObservation(
        provider="sandbox",
        attempt_id=attempt_id,
        status=ProviderStatus.RUNNING,
        source=Source.POLL,
        provider_sequence=step,
        provider_occurred_at=datetime.now(UTC),
        progress=min(99, 5 * step),
    )


async def advance(
    state: StateService, attempts: Iterable[uuid.UUID], steps: int, start: int = 1
) -> int:
    """Give each attempt ``steps`` progress observations from step ``start`` (each is applied:
    one version each)."""
    attempts = list(attempts)
    applied = 0
    for step in range(start, start + steps):
        results = await asyncio.gather(*(state.apply(progress(a, step)) for a in attempts))
        applied += sum(r.outcome is Outcome.APPLIED for r in results)
    return applied


async def outbox_counts(db: Database) -> dict[str, int]:
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT publish_status, count(*) AS n FROM outbox_events GROUP BY publish_status"
        )
    return {r["publish_status"]: r["n"] for r in rows}


async def outbox_routes(db: Database) -> dict[tuple[str, int], str]:
    """Every outbox row's routing class (its event_type), by (task id, version)."""
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT aggregate_id, aggregate_version, event_type FROM outbox_events"
        )
    return {(str(r["aggregate_id"]), r["aggregate_version"]): r["event_type"] for r in rows}


def assert_in_order_once(
    pairs: list[tuple[str, int]],
    expected: dict[str, int],
    routes: dict[tuple[str, int], str] | None = None,
) -> None:
    """Each task's versions 1..expected[task] exactly once, in increasing order: the bus's order.

    With ``routes`` (``outbox_routes``), what the dispatcher published: in increasing order
    within each topic (status changes, progress changes); the dispatcher reads the two topics
    in two loops, so the two may interleave differently (the gateway orders them by seq)."""
    by_task: dict[str, list[int]] = {}
    for task, version in pairs:
        by_task.setdefault(task, []).append(version)
    assert set(by_task) == set(expected)
    for task, versions in by_task.items():
        if routes is None:
            assert versions == list(range(1, expected[task] + 1)), (task, versions)
            continue
        assert sorted(versions) == list(range(1, expected[task] + 1)), (task, versions)
        for route in set(routes.values()):
            of_route = [v for v in versions if routes[(task, v)] == route]
            assert of_route == sorted(of_route), (task, route, versions)
