"""Propagation under faults: the broker goes away while tasks keep progressing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from aivedio.bus import BusConfig
from aivedio.bus.jetstream import JetStreamBus
from aivedio.db.pool import Database
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
)
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from aivedio.state.service import StateService
from tests.integration.helpers import make_project, make_task, store
from tests.integration.propagation import (
    Subscriber,
    advance,
    assert_in_order_once,
    bus_config,
    delete_streams,
    outbox_counts,
    outbox_routes,
    running,
)
from tests.proxy import TcpProxy


@pytest.fixture
async def cfg(nats_url: str) -> AsyncIterator[BusConfig]:
    config = bus_config(nats_url, storage="file")
    yield config
    await delete_streams(nats_url, config)


async def test_nats_outage_state_goes_on_backlog_drains_nothing_lost(
    db: Database, cfg: BusConfig, nats_url: str, redis_url: str
) -> None:
    target = urlsplit(nats_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 4222)
    await proxy.start()
    cut_cfg = replace(cfg, url=f"nats://127.0.0.1:{proxy.port}", publish_timeout_s=1.0)
    relay_bus = await JetStreamBus.connect(cut_cfg)
    dispatch_bus = await JetStreamBus.connect(cut_cfg)
    client = aioredis.Redis.from_url(redis_url)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    sub = Subscriber(client, broadcast_channel(prefix))
    await sub.start()

    state = StateService(db)
    project = await make_project(db)
    made = [await make_task(store(db, state), project) for _ in range(6)]
    attempts = [a for _, a in made]
    relay = OutboxRelay(
        db,
        relay_bus,
        RelayConfig(poll_interval_s=0.3, retry_base_s=0.2, retry_max_s=1.0, broker_pause_s=0.2),
    )
    dispatcher = NotificationDispatcher(
        dispatch_bus, RedisFanout(client), DispatcherConfig(channel_prefix=prefix, idle_fetch_s=0.3)
    )
    try:
        async with running(relay.run, dispatcher.run):
            await advance(state, attempts, 2)  # v2, v3
            await sub.wait_for(lambda: len(sub.received) >= 18)

            await proxy.cut()  # the broker is gone for relay and dispatcher
            assert await advance(state, attempts, 4, start=3) == 24  # state commits go on
            await asyncio.sleep(2.0)
            backlog, oldest = await relay.update_gauges()
            assert backlog == 24 and oldest > 0  # nothing could be published

            await proxy.start()  # the broker is back: the backlog drains
            await sub.wait_for(lambda: len(sub.received) >= 42, 40)
            await asyncio.sleep(0.3)
    finally:
        await sub.stop()
        await relay_bus.close()
        await dispatch_bus.close()
        await client.aclose()
        await proxy.cut()
    assert_in_order_once(sub.pairs(), {str(t): 7 for t, _ in made}, await outbox_routes(db))
    assert await outbox_counts(db) == {"published": 42}
