"""``aivedio outbox dead-letters|replay``: a row the broker kept rejecting is listed, replayed,
then published by the relay; the CLI answers in JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence

import pytest

from aivedio.bus import Bus, BusError, OutgoingMessage, PublishAck
from aivedio.db.pool import Database
from aivedio.propagation.outbox_admin import list_dead_letters, replay
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from tests.integration.helpers import make_project, make_task, store
from tests.integration.propagation import outbox_counts, private_bus


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    async with private_bus(nats_url) as b:
        yield b


class RejectingBus:
    """The broker refuses every message while ``rejecting`` (e.g. too large)."""

    def __init__(self, real: Bus) -> None:
        self.real = real
        self.rejecting = True

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        if self.rejecting:
            return [BusError("message too large") for _ in messages]
        return await self.real.publish_many(messages)


def cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AIVEDIO_DATABASE_URL=database_url)
    return subprocess.run(
        [sys.executable, "-m", "aivedio", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_dead_row_is_listed_replayed_and_published(
    db: Database, bus: Bus, database_url: str
) -> None:
    project = await make_project(db)
    task_id, _ = await make_task(store(db), project)
    broker = RejectingBus(bus)
    relay = OutboxRelay(db, broker, RelayConfig(retry_base_s=0.0, max_rejections=2))  # type: ignore[arg-type]
    for _ in range(2):
        assert (await relay.pump()).rejected == 1
    assert await outbox_counts(db) == {"dead": 1}

    (row,) = await list_dead_letters(db)
    assert (row["aggregate_id"], row["aggregate_version"]) == (str(task_id), 1)
    assert row["event_type"] == "task.status.changed" and row["retry_count"] == 2
    assert json.loads(row["payload"])["aggregate_id"] == str(task_id)
    assert row["truncated"] is False

    # The CLI prints the same row, then a count; replaying an unknown id fails with exit 1.
    listed = await asyncio.to_thread(cli, database_url, "dead-letters")
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(line) for line in listed.stdout.splitlines()]
    assert lines == [row, {"count": 1}]
    missing = await asyncio.to_thread(cli, database_url, "replay", "987654321")
    assert missing.returncode == 1
    assert json.loads(missing.stdout.splitlines()[-1]) == {"id": 987654321, "requeued": False}

    again = await asyncio.to_thread(cli, database_url, "replay", str(row["id"]))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1]) == {"id": row["id"], "requeued": True}
    assert await outbox_counts(db) == {"pending": 1}
    assert await list_dead_letters(db) == []
    assert not await replay(db, row["id"])  # not dead any more: left alone

    broker.rejecting = False
    result = await relay.pump()  # due at once, with a fresh try budget
    assert (result.claimed, result.published) == (1, 1)
    assert await outbox_counts(db) == {"published": 1}
    assert not await replay(db, row["id"])  # a published row is never requeued
