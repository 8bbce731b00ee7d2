"""The relay vacuums the outbox once it has drained a backlog (dead entries of published rows
sit where every claim starts scanning)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from aivedio.bus import Bus
from aivedio.db.pool import Database
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, make_task, store
from tests.integration.propagation import advance, outbox_counts, private_bus, running
from tests.waiting import eventually as wait_until


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    async with private_bus(nats_url) as b:
        yield b


async def vacuums(db: Database) -> int:
    async with db.connection() as conn:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        count: int = await conn.fetchval(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox_events'"
        )
    return count


async def test_relay_vacuums_after_a_drained_backlog_only(db: Database, bus: Bus) -> None:
    state = StateService(db)
    project = await make_project(db)
    attempts = [(await make_task(store(db, state), project))[1] for _ in range(4)]
    await advance(state, attempts, 2)  # 12 rows
    before = await vacuums(db)
    relay = OutboxRelay(db, bus, RelayConfig(vacuum_after_rows=10, batch_size=5))
    async with running(relay.run):

        async def drained_and_vacuumed() -> bool:
            return (await outbox_counts(db)) == {"published": 12} and await vacuums(db) > before

        await wait_until(drained_and_vacuumed, "the backlog drained and vacuumed", 20)
    after = await vacuums(db)

    # Below the threshold: no vacuum.
    quiet = OutboxRelay(db, bus, RelayConfig(vacuum_after_rows=100))
    await advance(state, attempts, 1, start=3)
    async with running(quiet.run):

        async def published() -> bool:
            return (await outbox_counts(db)) == {"published": 16}

        await wait_until(published, "the new rows published", 20)
    assert await vacuums(db) == after
