"""``aivedio run --role all`` with ``AIVEDIO_BUS=redis-streams``: a task's events ride the
Redis Streams bus from the outbox relay to the dispatcher and reach a browser's event stream."""

from __future__ import annotations

import uuid
from pathlib import Path

import redis.asyncio as aioredis

from aivedio.bus import BusConfig
from aivedio.bus.connect import connect
from aivedio.bus.redis_streams import RedisStreamsBus
from aivedio.client import Client
from aivedio.config import Settings
from tests.integration.chain import running_chain
from tests.integration.test_metrics import _async, listening, run_quick_task
from tests.waiting import eventually


async def test_settings_select_the_redis_streams_bus(redis_url: str, nats_url: str) -> None:
    settings = Settings(bus="redis-streams", bus_subject_prefix=f"sel-{uuid.uuid4().hex[:8]}")
    config = BusConfig.from_settings(settings, nats_url, redis_url)
    assert (config.adapter, config.url) == ("redis-streams", redis_url)
    bus = await connect(config)
    try:
        assert isinstance(bus, RedisStreamsBus)
    finally:
        await bus.close()
    assert BusConfig.from_settings(Settings(), nats_url, redis_url).url == nats_url


async def test_an_event_reaches_the_browser_over_redis_streams(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> None:
    prefix = f"chain-{uuid.uuid4().hex[:10]}"
    async with running_chain(
        database_url,
        redis_url,
        nats_url,
        tmp_path,
        bus="redis-streams",
        bus_subject_prefix=prefix,
    ) as chain:
        client = Client(chain.base, chain.api_key, chain.project_id)
        try:
            await client.snapshot()
            async with listening(client) as frames:
                task_id = await run_quick_task(chain)
                await eventually(
                    lambda: _async(
                        any(
                            f.data.get("task_id") == task_id and f.data.get("status") == "ready"
                            for f in frames
                        )
                    ),
                    "the ready frame of the task on the browser's stream",
                )
        finally:
            await client.aclose()
    # The events went through Redis Streams: the topic streams exist under the prefix.
    redis = aioredis.Redis.from_url(redis_url)
    try:
        streams = [k async for k in redis.scan_iter(match=f"{prefix}:s:*")]
        assert streams
        assert sum([await redis.xlen(k) for k in streams]) > 0
        keys = [k async for k in redis.scan_iter(match=f"{prefix}:*")]
        await redis.delete(*keys)
    finally:
        await redis.aclose()
