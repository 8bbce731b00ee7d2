"""The outbox relay on real PostgreSQL + NATS (+ Redis for the end-to-end checks)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis

from aivedio.bus import Bus, BusConfig, BusUnavailable, OutgoingMessage, PublishAck
from aivedio.bus.jetstream import JetStreamBus
from aivedio.bus.port import BusError
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
)
from aivedio.propagation.relay import (
    IDLE_LOCK,
    NOTIFY_CHANNEL,
    OutboxRelay,
    RelayConfig,
    dedup_id,
    mark_published_and_commit,
    stamped,
)
from aivedio.state.service import StateService
from tests.integration.helpers import holds_advisory_lock, make_project, make_task, store
from tests.integration.propagation import (
    Subscriber,
    advance,
    assert_in_order_once,
    bus_config,
    delete_streams,
    outbox_counts,
    outbox_routes,
    running,
    stream_messages,
)
from tests.waiting import eventually as wait_until


@pytest.fixture
async def cfg(nats_url: str) -> AsyncIterator[BusConfig]:
    config = bus_config(nats_url)
    yield config
    await delete_streams(nats_url, config)


@pytest.fixture
async def bus(cfg: BusConfig) -> AsyncIterator[Bus]:
    b = await JetStreamBus.connect(cfg)
    yield b
    await b.close()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def dispatcher_config(prefix: str) -> DispatcherConfig:
    return DispatcherConfig(channel_prefix=prefix, idle_fetch_s=0.3, redis_nak_delay_s=0.2)


async def tasks_with_versions(
    db: Database, count: int, steps: int
) -> tuple[StateService, list[uuid.UUID], dict[str, int]]:
    """``count`` tasks at version ``steps + 1`` (create = v1)."""
    state = StateService(db)
    project = await make_project(db)
    made = [await make_task(store(db, state), project) for _ in range(count)]
    await advance(state, [a for _, a in made], steps)
    return state, [a for _, a in made], {str(t): steps + 1 for t, _ in made}


async def test_events_flow_end_to_end_in_order(
    db: Database, bus: Bus, redis_client: aioredis.Redis
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    sub = Subscriber(redis_client, broadcast_channel(prefix))
    await sub.start()
    relay = OutboxRelay(db, bus, RelayConfig(batch_size=50))
    dispatcher = NotificationDispatcher(bus, RedisFanout(redis_client), dispatcher_config(prefix))
    state, attempts, expected = await tasks_with_versions(db, 8, 3)
    try:
        async with running(relay.run, dispatcher.run):
            await advance(
                state, attempts, 2, start=4
            )  # more while the relay runs (woken by NOTIFY)
            expected = {t: v + 2 for t, v in expected.items()}
            total = sum(expected.values())
            await sub.wait_for(lambda: len(sub.received) >= total)
            await asyncio.sleep(0.2)  # nothing more (no duplicates) arrives
    finally:
        await sub.stop()
    routes = await outbox_routes(db)
    assert_in_order_once(sub.pairs(), expected, routes)
    # Progress-only versions went to their own topic; the first progress of each task (it
    # starts running) and the task's creation did not.
    assert {v for (_, v), route in routes.items() if route == "task.status.changed"} == {1, 2}
    assert {v for (_, v), route in routes.items() if route == "task.progress.changed"} == {
        3,
        4,
        5,
        6,
    }
    first = sub.received[0]
    assert set(first) == {
        "type",
        "project_id",
        "epoch",
        "seq",
        "task_id",
        "task_version",
        "public",
        "stored_at",
        "relayed_at",
        "dispatched_at",
        "trace_id",
    }
    # Where the time went (bench e2e): the relay's publish, then the dispatcher's PUBLISH.
    for message in sub.received:
        assert message["stored_at"] <= message["relayed_at"] + 1.0  # DB and local clocks
        assert message["relayed_at"] <= message["dispatched_at"] <= time.time()
    assert first["public"]["event_id"] == first["seq"]
    assert "attempt_id" not in first["public"] and "trace_id" not in first["public"]
    assert await outbox_counts(db) == {"published": total}
    assert await relay.update_gauges() == (0, 0.0)


async def test_claim_takes_only_the_oldest_pending_row_of_each_task(db: Database) -> None:
    _, _, expected = await tasks_with_versions(db, 3, 2)  # 3 tasks x v1..v3
    async with db.transaction() as a, db.transaction() as b:
        first = await a.fetch(q("outbox_claim"), 100)
        assert sorted(r["aggregate_version"] for r in first) == [1, 1, 1]
        # Another relay: the heads are locked, their successors are blocked by them.
        assert await b.fetch(q("outbox_claim"), 100) == []
        await a.execute(q("outbox_mark_published"), [r["id"] for r in first[:1]])
    # Only the task whose v1 was published moves on to v2.
    async with db.transaction() as conn:
        again = await conn.fetch(q("outbox_claim"), 100)
    versions = {str(r["aggregate_id"]): r["aggregate_version"] for r in again}
    assert versions[str(first[0]["aggregate_id"])] == 2
    assert sorted(versions.values()) == [1, 1, 2]
    assert set(versions) == set(expected)


async def test_the_mark_and_the_commit_are_one_round_trip(db: Database) -> None:
    """The published mark goes with the round's COMMIT as one simple query; it marks exactly the
    acked rows, commits, and an UPDATE that fails skips the COMMIT (the round rolls back)."""
    await tasks_with_versions(db, 3, 0)  # 3 tasks x v1
    async with db.connection() as conn:
        await conn.execute("BEGIN")
        claimed = await conn.fetch(q("outbox_claim"), 100)
        acked = [r["id"] for r in claimed[:2]]
        await conn.execute(mark_published_and_commit(acked))
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM outbox_events") == 3
        published = await conn.fetch(
            "SELECT id FROM outbox_events WHERE publish_status = 'published' ORDER BY id"
        )
        assert [r["id"] for r in published] == sorted(acked)
        await conn.execute("BEGIN")
        await conn.fetch(q("outbox_claim"), 100)
        bad = mark_published_and_commit([claimed[2]["id"]]).replace("published_at", "nope", 1)
        with pytest.raises(asyncpg.UndefinedColumnError):
            await conn.execute(bad)
        assert conn.is_in_transaction()  # the COMMIT did not run
        await conn.execute("ROLLBACK")
    assert await outbox_counts(db) == {"published": 2, "pending": 1}
    assert mark_published_and_commit([]) == "COMMIT"


async def test_trigger_notifies_only_while_a_relay_holds_the_idle_lock(
    db: Database, database_url: str
) -> None:
    project = await make_project(db)
    tasks = store(db)
    listener = await asyncpg.connect(database_url)
    holder = await asyncpg.connect(database_url)
    got: list[str] = []
    await listener.add_listener(NOTIFY_CHANNEL, lambda *args: got.append(args[2]))
    try:
        await make_task(tasks, project)
        await asyncio.sleep(0.3)
        assert got == []  # no relay asleep: no NOTIFY, no commit-time lock
        await holder.execute("SELECT pg_advisory_lock($1)", IDLE_LOCK)
        await make_task(tasks, project)
        await wait_until(lambda: _true(bool(got)), "a notification", 5)
    finally:
        await holder.close()
        await listener.close()


async def _true(value: bool) -> bool:
    return value


async def test_idle_relay_is_woken_by_notify(db: Database, bus: Bus) -> None:
    # A poll interval far beyond the wait below: only the NOTIFY can wake it in time.
    relay = OutboxRelay(db, bus, RelayConfig(poll_interval_s=30.0))
    project = await make_project(db)
    async with running(relay.run):
        await wait_until(lambda: holds_advisory_lock(db, IDLE_LOCK), "the relay asleep on LISTEN")
        await make_task(store(db), project)

        async def published() -> bool:
            return (await outbox_counts(db)).get("published") == 1

        await wait_until(published, "the woken relay to publish", 10)


async def test_relay_killed_between_publish_and_mark_causes_no_duplicate(
    db: Database, bus: Bus, cfg: BusConfig, nats_url: str
) -> None:
    _, _, expected = await tasks_with_versions(db, 4, 2)
    crashes = 0

    async def crash(rows: Sequence[asyncpg.Record]) -> None:
        nonlocal crashes
        crashes += 1
        raise RuntimeError("relay killed after the broker acked, before the UPDATE")

    dying = OutboxRelay(db, bus, after_publish=crash)
    with pytest.raises(RuntimeError):
        await dying.pump()
    assert crashes == 1
    assert (await outbox_counts(db)) == {"pending": sum(expected.values())}  # rolled back
    relay = OutboxRelay(db, bus)
    while (await relay.pump()).claimed:
        pass
    assert (await outbox_counts(db)) == {"published": sum(expected.values())}
    stored = await stream_messages(nats_url, cfg)
    pairs = [(key, json.loads(data)["aggregate_version"]) for key, data in stored]
    assert_in_order_once(pairs, expected)  # Nats-Msg-Id absorbed the republished heads


class FlakyBus:
    """Fails the first publish of chosen dedup ids; everything else goes to the real bus."""

    def __init__(self, real: Bus, fail: set[str], error: BusError) -> None:
        self.real, self.fail, self.error = real, set(fail), error

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        failing = [m.dedup_id in self.fail for m in messages]
        self.fail -= {m.dedup_id for m in messages}
        results = await self.real.publish_many(
            [m for m, f in zip(messages, failing, strict=True) if not f]
        )
        it = iter(results)
        return [self.error if f else next(it) for f in failing]


async def test_failed_publish_is_retried_with_backoff_and_blocks_its_successors(
    db: Database, bus: Bus
) -> None:
    _, _, expected = await tasks_with_versions(db, 2, 1)  # v1, v2 of two tasks
    async with db.connection() as conn:
        heads = await conn.fetch(
            "SELECT id, aggregate_id, aggregate_version, event_type FROM outbox_events "
            "WHERE aggregate_version = 1 ORDER BY id"
        )
    failing = dedup_id(heads[0]["event_type"], heads[0]["aggregate_id"], 1)
    flaky = FlakyBus(bus, {failing}, BusUnavailable("broker away"))
    relay = OutboxRelay(db, flaky, RelayConfig(retry_base_s=0.3, retry_max_s=0.3))  # type: ignore[arg-type]
    first = await relay.pump()
    assert (first.claimed, first.published, first.unavailable) == (2, 1, 1)
    second = await relay.pump()  # the other task's v2 only: the failed head blocks its v2
    assert (second.claimed, second.published) == (1, 1)
    async with db.connection() as conn:
        row = await conn.fetchrow(
            "SELECT retry_count, next_retry_at > now() AS later, publish_status "
            "FROM outbox_events WHERE id = $1",
            heads[0]["id"],
        )
    assert (row["retry_count"], row["later"], row["publish_status"]) == (1, True, "pending")
    assert (await relay.pump()).claimed == 0  # not due yet
    await asyncio.sleep(0.4)
    assert (await relay.pump()).published == 1  # the retried head
    assert (await relay.pump()).published == 1  # then its successor
    assert await outbox_counts(db) == {"published": sum(expected.values())}


async def test_rejected_row_becomes_dead_after_max_rejections(db: Database, bus: Bus) -> None:
    project = await make_project(db)
    task_id, _ = await make_task(store(db), project)
    async with db.connection() as conn:
        version = await conn.fetchval(
            "SELECT aggregate_version FROM outbox_events WHERE aggregate_id=$1", task_id
        )
    flaky = FlakyBus(bus, set(), BusError("message too large"))
    relay = OutboxRelay(db, flaky, RelayConfig(retry_base_s=0.0, max_rejections=2))  # type: ignore[arg-type]
    for _ in range(2):
        flaky.fail.add(dedup_id("task.status.changed", task_id, version))
        assert (await relay.pump()).rejected == 1
    assert await outbox_counts(db) == {"dead": 1}


async def test_three_relays_publish_each_task_in_version_order(
    db: Database, bus: Bus, cfg: BusConfig, nats_url: str, redis_client: aioredis.Redis
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    sub = Subscriber(redis_client, broadcast_channel(prefix))
    await sub.start()
    state, attempts, expected = await tasks_with_versions(db, 12, 4)
    small = RelayConfig(batch_size=7, poll_interval_s=0.2)
    relays = [OutboxRelay(db, bus, small) for _ in range(3)]
    dispatcher = NotificationDispatcher(bus, RedisFanout(redis_client), dispatcher_config(prefix))
    try:
        async with running(dispatcher.run, *(r.run for r in relays)):
            await advance(state, attempts, 3, start=5)  # writers keep going while 3 relays race
            expected = {t: v + 3 for t, v in expected.items()}
            await sub.wait_for(lambda: len(sub.received) >= sum(expected.values()))
    finally:
        await sub.stop()
    assert_in_order_once(sub.pairs(), expected, await outbox_routes(db))
    # The bus itself holds every task's events in version order (the dispatcher's version
    # filter would hide a reordering, so look at the stream).
    stored = await stream_messages(nats_url, cfg)
    assert_in_order_once(
        [(key, json.loads(data)["aggregate_version"]) for key, data in stored], expected
    )


async def test_progress_versions_go_to_their_own_topic(
    db: Database, bus: Bus, cfg: BusConfig, nats_url: str
) -> None:
    """What media and billing read (``task.status``) holds every version but the progress-only
    ones, which go to ``task.progress`` (the dispatcher reads both)."""
    _, _, expected = await tasks_with_versions(db, 3, 4)  # v1 create, v2 running, v3-v5 progress
    relay = OutboxRelay(db, bus)
    while (await relay.pump()).claimed:
        pass
    nc = await nats.connect(nats_url)
    by_subject: dict[str, set[int]] = {}
    try:
        js = nc.jetstream()
        info = await js.stream_info(cfg.stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(cfg.stream, seq)
            version = json.loads(msg.data or b"{}")["aggregate_version"]
            by_subject.setdefault(msg.subject or "", set()).add(version)
    finally:
        await nc.close()
    prefix = cfg.subject_prefix
    assert by_subject == {f"{prefix}.task.status": {1, 2}, f"{prefix}.task.progress": {3, 4, 5}}
    assert set(expected.values()) == {5}


def test_the_bus_event_is_the_payload_with_the_relay_time_appended() -> None:
    payload = json.dumps({"event_type": "task.status.changed", "public": {"progress": 5}})
    suffix = ',"relayed_at":1767225600.250000}'
    assert json.loads(stamped(payload, suffix)) == json.loads(payload) | {
        "relayed_at": 1767225600.25
    }
    for other in ("{}", "[1]", '"text"'):
        assert stamped(other, suffix) == other.encode()
