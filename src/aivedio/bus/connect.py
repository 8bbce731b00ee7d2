"""Connect to the bus adapter a :class:`BusConfig` names (``AIVEDIO_BUS``)."""

from __future__ import annotations

from aivedio.bus.jetstream import JetStreamBus
from aivedio.bus.port import Bus, BusConfig
from aivedio.bus.redis_streams import RedisStreamsBus

__all__ = ["connect"]


async def connect(config: BusConfig) -> Bus:
    """A connected bus: JetStream (the default) or Redis Streams. Raises ``BusUnavailable``."""
    if config.adapter == "redis-streams":
        return await RedisStreamsBus.connect(config)
    return await JetStreamBus.connect(config)
