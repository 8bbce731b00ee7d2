"""The idle consumers' sleep (``aivedio.db.wakeup.IdleListener``) on real PostgreSQL: two
consumers of one table, one asleep holding the idle lock, the other asleep beside it; kicks are
never lost; writers whose consumer is kicked in memory notify no other."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.db.wakeup import IdleListener
from aivedio.ingest.processor import IDLE_LOCK, NOTIFY_CHANNEL
from aivedio.propagation.relay import IDLE_LOCK as OUTBOX_LOCK
from aivedio.propagation.relay import NOTIFY_CHANNEL as OUTBOX_CHANNEL
from tests.integration.helpers import holds_advisory_lock, notifications
from tests.waiting import eventually


def listener(db: Database) -> IdleListener:
    return IdleListener(
        db,
        channel=NOTIFY_CHANNEL,
        lock_key=IDLE_LOCK,
        has_work_sql=q("inbox_has_work"),
        poll_s=3600.0,  # the safety-net poll never ends a sleep in these tests
        name="test",
    )


@pytest.fixture
async def pair(db: Database) -> AsyncIterator[tuple[IdleListener, IdleListener]]:
    first, second = listener(db), listener(db)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


async def asleep(consumer: IdleListener, stopping: asyncio.Event) -> asyncio.Task[None]:
    job = asyncio.create_task(consumer.sleep(stopping))
    waits = consumer.waits

    def waiting() -> bool:
        if job.done():
            job.result()  # a sleep that ended (or failed) on its own: say so
            raise AssertionError("the sleep ended before anything woke it")
        return consumer.waits > waits

    await eventually(waiting, "the consumer waiting for a wake-up", 20)
    return job


async def test_a_kick_wakes_the_consumer_that_sleeps_beside_the_lock_holder(
    db: Database, pair: tuple[IdleListener, IdleListener]
) -> None:
    holder, beside = pair
    stopping = asyncio.Event()
    holding = await asleep(holder, stopping)
    assert await holds_advisory_lock(db, IDLE_LOCK)
    waiting = await asleep(beside, stopping)  # it could not take the lock: it sleeps anyway
    beside.kick()  # what the group commit of its process does after handing it rows
    await eventually(waiting.done, "the kicked consumer awake", 20)
    assert not holding.done()
    stopping.set()
    await asyncio.gather(holding, waiting)


async def test_both_sleepers_get_the_notification_of_another_process_s_write(
    db: Database, pair: tuple[IdleListener, IdleListener]
) -> None:
    holder, beside = pair
    stopping = asyncio.Event()
    holding = await asleep(holder, stopping)
    waiting = await asleep(beside, stopping)
    async with db.connection() as conn:  # a callback stored by another process: no kick
        await conn.execute(
            "INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash)"
            " VALUES ('sandbox', 'k1', '\\x00')"
        )
    await eventually(lambda: holding.done() and waiting.done(), "both consumers awake", 20)
    await asyncio.gather(holding, waiting)


async def test_a_kick_before_the_sleep_is_not_lost(
    pair: tuple[IdleListener, IdleListener],
) -> None:
    consumer, _ = pair
    consumer.kick()  # work committed while the consumer was looking for work
    # Returns at once (poll_s is an hour; the bound only names a hang as a failure).
    await asyncio.wait_for(consumer.sleep(asyncio.Event()), 20)
    assert consumer.waits == 0
    stopping = asyncio.Event()
    job = await asleep(consumer, stopping)  # the kick counted once: now it sleeps
    stopping.set()
    await job


async def test_only_callbacks_not_handed_to_a_processor_notify(db: Database) -> None:
    """A callback stored leased is handed to the inbox processor of its process in memory
    (aivedio.db.handoff): no other processor may claim it, so its INSERT wakes none of them
    (migration 0018); one stored unleased wakes the sleeping processors."""
    insert = (
        "INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash, lease_token,"
        " lease_until) VALUES ('sandbox', $1, '\\x00', $2, now() + interval '1 minute')"
    )
    async with notifications(db, NOTIFY_CHANNEL, IDLE_LOCK) as sent, db.connection() as conn:
        await conn.execute(insert, "handed", uuid.uuid4())
        assert await sent.count() == 0
        await conn.execute(insert, "unleased", None)
        assert await sent.count() == 1


async def test_an_outbox_write_marked_as_kicking_its_relay_notifies_no_relay(
    db: Database,
) -> None:
    """The inbox processor marks its apply transaction when an outbox relay of its process
    listens to its signal (queries/inbox.sql inbox_take_claimed): that relay is kicked in
    memory, so the outbox rows wake no other; an unmarked writer's rows notify."""
    insert = (
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, aggregate_version, event_type,"
        " payload, next_retry_at) VALUES ('task', $1, 1, 'test.quiet', '{}',"
        " now() + interval '1 hour')"  # parked: nothing here publishes it
    )
    async with notifications(db, OUTBOX_CHANNEL, OUTBOX_LOCK) as sent:
        async with db.transaction() as conn:
            await conn.execute("SELECT set_config('aivedio.relay_kicked', 'on', true)")
            await conn.execute(insert, uuid.uuid4())
        assert await sent.count() == 0
        async with db.transaction() as conn:  # the mark was the transaction's only
            await conn.execute(insert, uuid.uuid4())
        assert await sent.count() == 1


async def test_a_nap_ends_with_a_kick_and_says_whether_one_came(
    pair: tuple[IdleListener, IdleListener],
) -> None:
    consumer, _ = pair
    consumer.kick()
    assert await consumer.nap(asyncio.Event(), 3600.0)  # at once: the kick came before
    assert not await consumer.nap(asyncio.Event(), 0.001)  # the kick counted once
    stopping = asyncio.Event()
    napping = asyncio.create_task(consumer.nap(stopping, 3600.0))
    consumer.kick()
    assert await asyncio.wait_for(napping, 20)  # the bound only names a hang as a failure


async def test_writers_holding_the_lock_send_the_consumer_back_to_work_not_to_sleep(
    db: Database, pair: tuple[IdleListener, IdleListener]
) -> None:
    first, second = pair
    async with db.connection() as writer, writer.transaction():
        # What an outbox or inbox trigger takes until its transaction commits.
        assert await writer.fetchval("SELECT pg_try_advisory_xact_lock_shared($1)", IDLE_LOCK)
        # Writers will not notify, so a sleep now could miss their rows: the consumer waits
        # LOCK_WAIT_MS at most and looks again (poll_s is an hour; the bound names a hang).
        await asyncio.wait_for(first.sleep(asyncio.Event()), 20)
        assert first.waits == 0
    stopping = asyncio.Event()  # the consumer's shared try gave the lock back: it is free
    job = await asleep(second, stopping)
    assert await holds_advisory_lock(db, IDLE_LOCK)
    stopping.set()
    await job
