"""Helpers for the media and billing consumer tests: play the outbox relay, run a consumer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aivedio.bus.port import Bus, Consumer, Delivery
from aivedio.db.pool import Database
from aivedio.domain.observation import (
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from aivedio.state.service import StateService


async def outbox_payloads(db: Database, task_id: uuid.UUID | None = None) -> list[tuple[int, Any]]:
    async with db.connection() as conn:
        rows = await conn.fetch(
            "SELECT id, payload FROM outbox_events "
            "WHERE $1::uuid IS NULL OR aggregate_id = $1 ORDER BY id",
            task_id,
        )
    return [(r["id"], r["payload"]) for r in rows]


async def publish_outbox(
    db: Database, bus: Bus, *, copies: int = 1, task_id: uuid.UUID | None = None
) -> int:
    """Publish outbox rows as the relay does (payload = the row's JSON payload, key = task id).
    ``copies > 1`` publishes each row again under another dedup id, as a relay that lost its
    "mark published" beyond the duplicate window would."""
    rows = await outbox_payloads(db, task_id)
    for outbox_id, payload in rows:
        body = json.dumps(payload).encode()
        for copy in range(copies):
            dedup = str(outbox_id) if copy == 0 else f"{outbox_id}-again-{copy}"
            await bus.publish("task.status", payload["aggregate_id"], dedup, body)
    return len(rows)


@contextlib.asynccontextmanager
async def running(loop: Callable[[asyncio.Event], Awaitable[None]]) -> AsyncIterator[None]:
    """Run ``loop(stopping)`` in the background for the block, then stop it (bounded)."""
    stopping = asyncio.Event()
    job = asyncio.create_task(loop(stopping))
    try:
        yield
    finally:
        stopping.set()
        await asyncio.wait_for(job, 20)


@dataclass
class AckLoser:
    """Wraps a bus so that every consumer "loses" the acks of the first ``lose`` deliveries of
    each message: the broker redelivers them after its ack wait, as after a consumer crash
    between commit and ack."""

    bus: Bus
    lose: int
    handled: dict[str, int]

    async def subscribe(self, topic: str, group: str, **kw: Any) -> Consumer:
        return _LosingConsumer(await self.bus.subscribe(topic, group, **kw), self)  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bus, name)


class _LosingConsumer:
    def __init__(self, inner: Consumer, owner: AckLoser) -> None:
        self.inner = inner
        self.owner = owner
        self.topic, self.group = inner.topic, inner.group

    async def fetch(self, batch: int = 100, timeout: float = 1.0) -> list[Delivery]:
        return [_LosingDelivery(d, self.owner) for d in await self.inner.fetch(batch, timeout)]  # type: ignore[misc]

    async def close(self) -> None:
        await self.inner.close()


class _LosingDelivery:
    def __init__(self, inner: Delivery, owner: AckLoser) -> None:
        self.inner = inner
        self.owner = owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def ack(self) -> None:
        counts: dict[str, int] = self.owner.handled
        counts[self.inner.dedup_id] = counts.get(self.inner.dedup_id, 0) + 1
        if self.inner.deliveries > self.owner.lose:
            await self.inner.ack()


def prov(attempt_id: uuid.UUID, status: ProviderStatus, **kw: Any) -> ProviderObservation:
    return ProviderObservation(
        provider="sandbox", attempt_id=attempt_id, status=status, source=Source.POLL, **kw
    )


def platform(kind: PlatformKind, attempt_id: uuid.UUID, **kw: Any) -> PlatformObservation:
    source = Source.MEDIA if kind.value.startswith("media") else Source.SUBMIT
    return PlatformObservation(kind=kind, attempt_id=attempt_id, source=source, **kw)


async def apply_all(state: StateService, observations: list[Any]) -> None:
    for obs in observations:
        result = await state.apply(obs)
        assert result.outcome.value == "applied", (obs, result)


def counts(rows: list[Mapping[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row[key]] = out.get(row[key], 0) + 1
    return out
