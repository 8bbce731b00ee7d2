"""The ``relay`` and ``dispatcher`` roles for ``aivedio run --role ...``.

Each factory returns one background loop. The loop connects to the bus itself and keeps trying
while the broker is away (the outbox keeps growing meanwhile; nothing is lost; the loop reports
an outage of the ``bus`` meanwhile), so a role never fails its process because NATS or Redis is
down at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from aivedio.bus import Bus, BusConfig, BusUnavailable
from aivedio.bus.connect import connect
from aivedio.fanout.redis import RedisFanout
from aivedio.logs import log
from aivedio.process import health
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.propagation.dispatcher import DispatcherConfig, NotificationDispatcher, Router
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from aivedio.runtime import Runtime

if TYPE_CHECKING:
    import redis.asyncio as aioredis


__all__ = ["connect_bus", "dispatcher_role", "relay_role"]

logger = logging.getLogger("aivedio.propagation")


async def connect_bus(config: BusConfig, stopping: asyncio.Event) -> Bus | None:
    """Connect to the configured bus, retrying with backoff; ``None`` once ``stopping`` is set."""
    delay = 0.5
    while not stopping.is_set():
        try:
            bus = await connect(config)
        except BusUnavailable as exc:
            log(logger, logging.WARNING, "bus unavailable, retrying", error=str(exc), in_s=delay)
            health.outage("bus", exc)
        else:
            health.recovered()
            return bus
        try:
            await asyncio.wait_for(stopping.wait(), timeout=delay)
        except TimeoutError:
            delay = min(delay * 2, 10.0)
    return None


async def relay_role(
    rt: Runtime,
    *,
    bus_config: BusConfig | None = None,
    config: RelayConfig | None = None,
    replicas: int = 1,
) -> RoleParts:
    """``replicas`` relay loops in this process (each one claims its own batches)."""
    bus_cfg = bus_config or BusConfig.from_settings(
        rt.settings, rt.urls.nats_url, rt.urls.redis_url
    )

    async def loop(stopping: asyncio.Event) -> None:
        bus = await connect_bus(bus_cfg, stopping)
        if bus is None:
            return
        relays = [OutboxRelay(rt.db, bus, config) for _ in range(max(1, replicas))]
        for relay in relays:
            rt.wakeups.outbox.subscribe(relay.idle.kick)
        try:
            await asyncio.gather(*(r.run(stopping) for r in relays))
        finally:
            for relay in relays:
                rt.wakeups.outbox.unsubscribe(relay.idle.kick)
            await bus.close()

    return RoleParts(loops=[RoleLoop("relay", loop)])


RouterFactory = Callable[
    ["aioredis.Redis", asyncio.Event], contextlib.AbstractAsyncContextManager[Router]
]
"""Makes the dispatcher's router on its Redis client and keeps it running while in use."""


async def dispatcher_role(
    rt: Runtime,
    *,
    bus_config: BusConfig | None = None,
    config: DispatcherConfig | None = None,
    router: RouterFactory | None = None,
) -> RoleParts:
    """The ``dispatcher`` role: broadcast fan-out, or the routes ``router`` makes (node mode)."""
    bus_cfg = bus_config or BusConfig.from_settings(
        rt.settings, rt.urls.nats_url, rt.urls.redis_url
    )
    cfg = config or DispatcherConfig(max_deliver=bus_cfg.max_deliver)

    async def loop(stopping: asyncio.Event) -> None:
        bus = await connect_bus(bus_cfg, stopping)
        if bus is None:
            return
        fanout = RedisFanout.from_url(rt.urls.redis_url, timeout_s=cfg.redis_timeout_s)
        try:
            # The node router reads the route registry on the fan-out's Redis client.
            routing = router(fanout.client, stopping) if router else contextlib.nullcontext(None)
            async with routing as routes:
                await NotificationDispatcher(bus, fanout, cfg, router=routes).run(stopping)
        finally:
            await fanout.close()
            await bus.close()

    return RoleParts(loops=[RoleLoop("dispatcher", loop)])
