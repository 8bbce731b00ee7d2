"""Connection limits: per-user and per-tenant counters in Redis, a per-process connect rate.

The counters' TTL is longer than the session cap (seed 004: a counter that expires under a live
connection lets extra connections in), refreshed by every connect; a crashed node's counts age out
after that TTL. Releases are batched into one pipeline per second. Redis being down fails open:
correctness never depends on Redis, only the limit is not enforced meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from aivedio.gateway.session import Identity
from aivedio.logs import log

logger = logging.getLogger("aivedio.gateway")


class ConnectRate:
    """A token bucket of new connections per second; ``take`` returns the seconds to wait."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s = per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> float:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.per_s


class ConnectionCounters:
    def __init__(
        self, redis: Redis, prefix: str, ttl_s: int, max_per_user: int, max_per_tenant: int
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_per_user = max_per_user
        self.max_per_tenant = max_per_tenant
        self._releases: list[str] = []

    def _keys(self, identity: Identity) -> tuple[str, str]:
        return (
            f"{self.prefix}:conns:user:{identity.user_id}",
            f"{self.prefix}:conns:tenant:{identity.tenant_id}",
        )

    async def acquire(self, identity: Identity) -> str | bool | None:
        """``None``: counted; ``"user"``/``"tenant"``: that limit is reached (not counted);
        ``False``: Redis unavailable (allowed, not counted)."""
        user, tenant = self._keys(identity)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incr(user)
            pipe.expire(user, self.ttl_s)
            pipe.incr(tenant)
            pipe.expire(tenant, self.ttl_s)
            users, _, tenants, _ = await pipe.execute()
        except (RedisError, OSError) as exc:
            log(logger, logging.WARNING, "connection counters unavailable", error=repr(exc))
            return False
        over = (
            "user"
            if users > self.max_per_user
            else "tenant"
            if tenants > self.max_per_tenant
            else None
        )
        if over is not None:
            self.release(identity)
        return over

    def release(self, identity: Identity) -> None:
        self._releases.extend(self._keys(identity))

    async def flush(self) -> None:
        releases, self._releases = self._releases, []
        if not releases:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in releases:
                pipe.decr(key)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log(logger, logging.WARNING, "connection counters unavailable", error=repr(exc))

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)
            await self.flush()
