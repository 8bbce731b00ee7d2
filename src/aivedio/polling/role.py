"""The ``poller`` role: one poll scheduler (claim loop + query workers) per process.

Configuration comes from the runtime's settings (:func:`poller_config`): the adapters of
``providers.registry``, Redis at ``urls.redis_url`` (rate-limit buckets, online interest), and:

- ``poll_limits: str`` — ``AIVEDIO_POLL_LIMITS``, see :func:`aivedio.polling.config.parse_limits`;
- ``poll_replicas: int`` — ``AIVEDIO_POLL_REPLICAS``, poller processes sharing the limits;
- ``poll_concurrency: int`` — ``AIVEDIO_POLL_CONCURRENCY``, queries in flight per process.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from aivedio.config import Settings
from aivedio.polling.config import PollerConfig, RateLimitConfig, parse_limits
from aivedio.polling.poller import Poller
from aivedio.polling.ratelimit import RateLimiter
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.providers.registry import build_providers, providers_config
from aivedio.runtime import Runtime


def poller_config(settings: Settings) -> PollerConfig:
    """The poller's config from the settings (fields read only when the settings have them)."""
    limits = parse_limits(settings.poll_limits, RateLimitConfig(replicas=settings.poll_replicas))
    return PollerConfig(
        concurrency=settings.poll_concurrency, limits=limits, lease_s=settings.poll_lease_s
    )


async def poller_role(rt: Runtime, config: PollerConfig | None = None) -> RoleParts:

    config = config or poller_config(rt.settings)

    async def loop(stopping: asyncio.Event) -> None:
        redis = aioredis.from_url(
            rt.urls.redis_url,
            socket_timeout=config.limits.redis_timeout_s,
            socket_connect_timeout=config.limits.redis_timeout_s,
        )
        adapters = build_providers(providers_config(rt.settings))
        try:
            limiter = RateLimiter(redis, config.limits)
            poller = Poller(rt.db, rt.state, adapters, limiter, config, redis=redis)
            await poller.run(stopping)
        finally:
            for adapter in adapters.values():
                await adapter.aclose()
            await redis.aclose()

    return RoleParts(loops=[RoleLoop("poller", loop)])


__all__ = ["poller_config", "poller_role"]
