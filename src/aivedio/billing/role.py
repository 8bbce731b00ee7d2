"""The ``billing`` role. Register in ``roles.AVAILABLE`` as ``"billing": billing_role``."""

from __future__ import annotations

import asyncio

from aivedio.billing.config import BillingConfig
from aivedio.billing.consumer import BillingConsumer
from aivedio.bus.port import BusConfig
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.propagation.roles import connect_bus
from aivedio.runtime import Runtime


async def billing_role(
    rt: Runtime, config: BillingConfig | None = None, bus_config: BusConfig | None = None
) -> RoleParts:
    consumer = BillingConsumer(rt.db, config or BillingConfig())

    async def consume(stopping: asyncio.Event) -> None:
        bus = await connect_bus(
            bus_config or BusConfig.from_settings(rt.settings, rt.urls.nats_url, rt.urls.redis_url),
            stopping,
        )
        if bus is None:
            return
        try:
            await consumer.run(bus, stopping)
        finally:
            await bus.close()

    return RoleParts(loops=[RoleLoop("consumer", consume)])
