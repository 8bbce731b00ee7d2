"""The bus contract against a real Redis 7 / Valkey server (the Redis Streams adapter)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from aivedio.bus import Bus, BusUnavailable
from aivedio.bus.redis_streams import RedisStreamsBus
from tests.contract.bus_contract import BusContract, BusFactory, contract_config


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
