"""Connect to the bus adapter a :class:`BusConfig` names (``AIVEDIO_BUS``)."""

from __future__ import annotations

from aivedio.bus.port import Bus, BusConfig

__all__ = ["connect"]


async def connect(config: BusConfig) -> Bus:
    """A connected bus: JetStream (the default) or Redis Streams. Raises ``BusUnavailable``."""
    if config.adapter == "redis-streams":
        from aivedio.bus.redis_streams import RedisStreamsBus  # only the chosen driver is loaded

        return await RedisStreamsBus.connect(config)
    from aivedio.bus.jetstream import JetStreamBus

    return await JetStreamBus.connect(config)
