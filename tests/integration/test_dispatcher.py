"""The notification dispatcher on real NATS and Redis: version dedup, poison -> dead letter,
Redis outage -> nak and recovery."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from aivedio.bus import Bus, BusConfig
from aivedio.bus.jetstream import JetStreamBus
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dead_letters import list_dead_letters, replay_dead_letter
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
)
from tests.integration.propagation import Subscriber, bus_config, delete_streams, running
from tests.proxy import TcpProxy
from tests.waiting import eventually as wait_until


@pytest.fixture
async def cfg(nats_url: str) -> AsyncIterator[BusConfig]:
    config = bus_config(nats_url, max_deliver=3)
    yield config
    await delete_streams(nats_url, config)


@pytest.fixture
async def bus(cfg: BusConfig) -> AsyncIterator[Bus]:
    b = await JetStreamBus.connect(cfg)
    yield b
    await b.close()


@pytest.fixture
async def direct_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def config(prefix: str, **kw: Any) -> DispatcherConfig:
    base: dict[str, Any] = {
        "channel_prefix": prefix,
        "idle_fetch_s": 0.3,
        "max_deliver": 3,
        "malformed_delay_s": 0.05,
        "redis_nak_delay_s": 0.1,
        "redis_timeout_s": 0.5,
        "redis_probe_s": 0.1,
    }
    return DispatcherConfig(**(base | kw))


def event(task: str, version: int, seq: int) -> bytes:
    return json.dumps(
        {
            "event_type": "task.status.changed",
            "aggregate_id": task,
            "aggregate_version": version,
            "project_id": "p-1",
            "epoch": 3,
            "event_id": seq,
            "status": "running",
            "attempt_id": "secret-internal",
            "public": {"task_id": task, "task_version": version, "status": "generating"},
        }
    ).encode()


async def test_duplicates_and_stale_versions_are_dropped(
    bus: Bus, direct_redis: aioredis.Redis
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    sub = Subscriber(direct_redis, broadcast_channel(prefix))
    await sub.start()
    dispatcher = NotificationDispatcher(bus, RedisFanout(direct_redis), config(prefix))
    # Distinct dedup ids: these got past the broker's window (a relay retry hours later, say).
    sends = [("a", 1, 1), ("a", 2, 2), ("a", 2, 2), ("b", 1, 3), ("a", 1, 1), ("a", 3, 4)]
    for i, (task, version, seq) in enumerate(sends):
        await bus.publish("task.status", task, f"d{i}", event(task, version, seq))
    other = json.dumps({"event_type": "task.created"}).encode()
    await bus.publish("task.status", "c", "other", other)
    try:
        async with running(dispatcher.run):
            await sub.wait_for(lambda: len(sub.received) >= 4)
            await bus.publish("task.status", "a", "late", event("a", 3, 4))
            await bus.publish("task.status", "a", "fresh", event("a", 4, 5))
            await sub.wait_for(lambda: len(sub.received) >= 5)
    finally:
        await sub.stop()
    assert sub.pairs() == [("a", 1), ("a", 2), ("b", 1), ("a", 3), ("a", 4)]
    msg = sub.received[0]
    assert isinstance(msg.pop("dispatched_at"), float)  # this batch's PUBLISH (bench e2e)
    assert msg == {
        "type": "task.status",
        "project_id": "p-1",
        "epoch": 3,
        "seq": 1,
        "task_id": "a",
        "task_version": 1,
        "public": {"task_id": "a", "task_version": 1, "status": "generating", "event_id": 1},
        "stored_at": None,  # published here without the relay's stamps
        "relayed_at": None,
        "trace_id": None,
    }


async def test_poison_message_is_dead_lettered_and_listed(
    bus: Bus, direct_redis: aioredis.Redis
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    sub = Subscriber(direct_redis, broadcast_channel(prefix))
    await sub.start()
    dispatcher = NotificationDispatcher(bus, RedisFanout(direct_redis), config(prefix))
    await bus.publish("task.status", "poison-task", "p-1", b"{not json")
    await bus.publish("task.status", "good", "g-1", event("good", 1, 1))
    try:
        async with running(dispatcher.run):
            await sub.wait_for(lambda: len(sub.received) >= 1)
            letters: list[dict[str, Any]] = []

            async def dead() -> bool:
                letters[:] = await list_dead_letters(bus, "dispatcher", 10)
                return bool(letters)

            await wait_until(dead, "the dead letter", 20)
    finally:
        await sub.stop()
    [letter] = letters
    assert letter["key"] == "poison-task" and letter["dedup_id"] == "p-1"
    assert letter["deliveries"] == 3 and letter["reason"].startswith("malformed: not JSON")
    assert letter["data"] == "{not json" and letter["topic"] == "task.status"
    json.dumps(letter)  # JSON-ready for the CLI
    replayed = await replay_dead_letter(bus, "dispatcher", letter["id"])
    assert replayed["replayed"] == letter["id"]
    assert await list_dead_letters(bus, "dispatcher", 10) == []
    assert sub.pairs() == [("good", 1)]


async def test_redis_outage_naks_and_loses_nothing(
    bus: Bus, direct_redis: aioredis.Redis, redis_url: str
) -> None:
    target = urlsplit(redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    parts = urlsplit(redis_url)
    via = parts._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    cfg = config(prefix, max_deliver=50)
    cut = RedisFanout.from_url(via, timeout_s=cfg.redis_timeout_s)
    sub = Subscriber(direct_redis, broadcast_channel(prefix))
    await sub.start()
    dispatcher = NotificationDispatcher(bus, cut, cfg)
    errors_before = redis_errors()
    try:
        async with running(dispatcher.run):
            await bus.publish("task.status", "a", "a1", event("a", 1, 1))
            await sub.wait_for(lambda: len(sub.received) >= 1)
            await proxy.cut()
            # One event per task: the bus may redeliver nak-ed events in another order, and a
            # later version of a task published first supersedes an earlier one by design (the
            # gateway repairs from PostgreSQL); with one each, every event must reach Redis.
            tasks = "bcdef"
            for seq, task in enumerate(tasks, start=2):
                await bus.publish("task.status", task, f"{task}1", event(task, 1, seq))
            await sub.wait_for(lambda: redis_errors() > errors_before, 10)
            await proxy.start()
            await sub.wait_for(lambda: len(sub.received) >= 6, 20)
    finally:
        await sub.stop()
        await proxy.cut()
        await cut.close()
    assert sorted(sub.pairs()) == [(task, 1) for task in "a" + tasks]


def redis_errors() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("aivedio_dispatch_redis_errors_total") or 0.0
