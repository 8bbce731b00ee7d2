"""The bus contract against a real Redis 7 / Valkey server (the Redis Streams adapter)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from aivedio.bus import Bus, BusUnavailable
from aivedio.bus.redis_streams import RedisStreamsBus
from tests.contract.bus_contract import (
    ACK_WAIT_S,
    MAX_DELIVER,
    TOPIC,
    BusContract,
    BusFactory,
    contract_config,
    fetch_n,
    fetch_none,
)


async def _delete_namespace(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


class TestRedisStreamsBus(BusContract):
    @pytest.fixture
    async def bus_factory(self, redis_url: str) -> AsyncIterator[BusFactory]:
        cfg = contract_config(redis_url)
        buses: list[Bus] = []

        async def factory() -> Bus:
            bus = await RedisStreamsBus.connect(cfg)
            buses.append(bus)
            return bus

        yield factory
        for bus in buses:
            await bus.close()
        await _delete_namespace(redis_url, cfg.subject_prefix)


async def test_unreachable_server_is_bus_unavailable() -> None:
    cfg = contract_config("redis://127.0.0.1:1/0")
    with pytest.raises(BusUnavailable):
        await RedisStreamsBus.connect(cfg)


async def test_delayed_naks_keep_exact_counts_and_leave_nothing_parked(redis_url: str) -> None:
    cfg = contract_config(redis_url)
    bus = await RedisStreamsBus.connect(cfg)
    client = aioredis.Redis.from_url(redis_url)
    try:
        consumer = await bus.subscribe(TOPIC, "g1")
        await bus.publish(TOPIC, "task-1", "late", b"x")
        zset, data = bus._parked("g1", TOPIC)
        counts = []
        for _ in range(MAX_DELIVER):
            [d] = await fetch_n(consumer, 1, within_s=2 * ACK_WAIT_S + 10)
            counts.append(d.deliveries)
            await d.nak(delay_s=1.5 * ACK_WAIT_S)
            if d.deliveries < MAX_DELIVER:
                assert await client.zcard(zset) == 1  # parked, not pending
                assert await client.xpending(bus._stream(TOPIC), "g1") == {
                    "pending": 0,
                    "min": None,
                    "max": None,
                    "consumers": [],
                }
        assert counts == list(range(1, MAX_DELIVER + 1))
        [letter] = await bus.dead_letters("g1")
        assert (letter.deliveries, letter.reason) == (MAX_DELIVER, "max_deliver")
        assert await client.zcard(zset) == 0
        assert await client.hlen(data) == 0
        assert await client.hlen(bus._counts("g1")) == 0
        # A nak of an entry no longer pending parks nothing (a retried nak, or one after the ack).
        await bus.publish(TOPIC, "task-2", "once", b"y")
        [d] = await fetch_n(consumer, 1)
        await d.ack()
        await d.nak(delay_s=1.5 * ACK_WAIT_S)
        assert await client.zcard(zset) == 0
        assert await fetch_none(consumer, for_s=2 * ACK_WAIT_S) == []
    finally:
        await bus.close()
        await client.aclose()
        await _delete_namespace(redis_url, cfg.subject_prefix)
