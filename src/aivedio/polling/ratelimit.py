"""Rate limits shared by every poller replica: token buckets in Redis, a local fallback.

One Lua script checks and takes from the four buckets of a query (global, provider,
provider+model, tenant) atomically: all of them or none. The script reads Redis's own clock,
so replicas with skewed clocks share one timeline. A provider that answered 429 is put on hold
(``penalize``): a key with a TTL that the script checks first.

When Redis does not answer (connection error, timeout, script error), the limiter switches to
LOCAL buckets holding ``limit / replicas`` (``replicas`` = the larger of the configured count and
the number of replicas last seen heart-beating in Redis), which start EMPTY: the switch never adds
a burst. It tries Redis again every ``redis_retry_s`` and goes back as soon as Redis answers.
Slower, never over (docs/explanation/polling.md has the arithmetic).

Online interest: the notification gateway marks the tasks (or projects) someone is watching with
:func:`mark_interest`; the poller reads them with :func:`watched` and polls those tasks sooner.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from aivedio.channels import INTEREST_PREFIX
from aivedio.logs import log
from aivedio.polling.buckets import Bucket, Grant, Limit, take_all
from aivedio.polling.config import RateLimitConfig

logger = logging.getLogger("aivedio.polling.ratelimit")

TOKENS_DENIED = Counter(
    "aivedio_poll_tokens_denied_total",
    "Token requests that got nothing, by provider and limiter mode",
    ["provider", "mode"],
)
TOKENS_GRANTED = Counter(
    "aivedio_poll_tokens_granted_total",
    "Tokens granted, by provider and mode",
    ["provider", "mode"],
)
FALLBACK = Gauge("aivedio_ratelimit_fallback", "1 while this limiter uses its local buckets")
FALLBACK_SWITCHES = Counter(
    "aivedio_ratelimit_fallback_switches_total", "Switches between Redis and local", ["to"]
)

Mode = Literal["redis", "local"]

# KEYS: n bucket keys, then the provider's hold key.
# ARGV: want, ttl_ms, then qps_1, burst_1, ..., qps_n, burst_n.
# Returns {granted, wait_ms}: all buckets give `granted` tokens, or none gives any.
TAKE_SCRIPT = """
local n = #KEYS - 1
local hold = redis.call('PTTL', KEYS[n + 1])
if hold > 0 then return {0, hold} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local want = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local levels = {}
local grant = want
for i = 1, n do
  local qps = tonumber(ARGV[1 + 2 * i])
  local burst = tonumber(ARGV[2 + 2 * i])
  local v = redis.call('HMGET', KEYS[i], 't', 's')
  local tokens = tonumber(v[1])
  local stamp = tonumber(v[2])
  if tokens == nil or stamp == nil then
    tokens = burst
    stamp = now
  end
  local elapsed = now - stamp
  if elapsed < 0 then elapsed = 0 end
  local level = math.min(burst, tokens + elapsed * qps)
  levels[i] = level
  local whole = math.floor(level + 1e-9)
  if whole < grant then grant = whole end
end
if grant < 1 then
  local wait = 0
  for i = 1, n do
    if levels[i] + 1e-9 < 1 then
      local w = (1 - levels[i]) / tonumber(ARGV[1 + 2 * i])
      if w > wait then wait = w end
    end
  end
  return {0, math.ceil(wait * 1000)}
end
local stamp = string.format('%.6f', now)
for i = 1, n do
  redis.call('HSET', KEYS[i], 't', string.format('%.6f', levels[i] - grant), 's', stamp)
  redis.call('PEXPIRE', KEYS[i], ttl)
end
return {grant, 0}
"""

# Errors that mean "Redis is not there right now".
REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Scope:
    """Who a query is for: picks its four buckets."""

    provider: str
    model: str
    tenant: str


class RateLimiter:
    """Four-level token buckets in Redis, with a conservative local fallback."""

    def __init__(
        self,
        redis: aioredis.Redis | None,
        config: RateLimitConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        instance_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.config = config
        self.clock = clock
        self.instance_id = instance_id or uuid.uuid4().hex
        self.mode: Mode = "redis" if redis is not None else "local"
        self._script = redis.register_script(TAKE_SCRIPT) if redis is not None else None
        self._retry_at = 0.0
        self._local: dict[str, Bucket] = {}
        self._holds: dict[str, float] = {}
        self._divisor = config.replicas
        self._beat_at = -math.inf
        self._tag = "{" + config.prefix + "}"
        FALLBACK.set(1 if self.mode == "local" else 0)

    # -- keys and limits ------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return ":".join((self._tag, *parts))

    def levels(self, scope: Scope) -> list[tuple[str, Limit]]:
        cfg = self.config
        levels = [
            (self.key("g"), cfg.global_limit),
            (self.key("p", scope.provider), cfg.provider_limit(scope.provider)),
        ]
        model = cfg.model_limit(scope.provider, scope.model)
        if model is not None:
            levels.append((self.key("m", scope.provider, scope.model), model))
        levels.append((self.key("t", scope.tenant), cfg.tenant_limit(scope.tenant)))
        return levels

    @property
    def divisor(self) -> int:
        """How many replicas the local fallback assumes share the limits."""
        return max(self.config.replicas, self._divisor)

    # -- taking ---------------------------------------------------------------------------

    async def take(self, scope: Scope, want: int = 1) -> Grant:
        """Up to ``want`` tokens from all four buckets of ``scope``, or none and a wait."""
        if want < 1:
            return Grant(0, 0.0)
        grant: Grant | None = None
        if self._script is not None and (self.mode == "redis" or self.clock() >= self._retry_at):
            grant = await self._take_redis(scope, want)
        if grant is None:
            grant = self._take_local(scope, want)
        counter = TOKENS_GRANTED if grant.granted else TOKENS_DENIED
        counter.labels(scope.provider, self.mode).inc(grant.granted or 1)
        return grant

    async def _take_redis(self, scope: Scope, want: int) -> Grant | None:
        assert self._script is not None
        assert self.redis is not None
        levels = self.levels(scope)
        keys = [k for k, _ in levels] + [self.key("hold", scope.provider)]
        args: list[Any] = [want, self._ttl_ms(levels)]
        for _, limit in levels:
            args += [repr(limit.qps), repr(limit.burst)]
        try:
            async with asyncio.timeout(self.config.redis_timeout_s):
                await self._heartbeat()
                result = await self._script(keys=keys, args=args)
        except REDIS_DOWN as exc:
            self._fall_back(exc)
            return None
        if self.mode == "local":
            self._recover()
        granted, wait_ms = int(result[0]), int(result[1])
        return Grant(granted, wait_ms / 1000 if not granted else 0.0)

    def _take_local(self, scope: Scope, want: int) -> Grant:
        now = self.clock()
        hold = self._holds.get(scope.provider, 0.0)
        if hold > now:
            return Grant(0, hold - now)
        parts = self.divisor
        pairs: list[tuple[Bucket, Limit]] = []
        for key, limit in self.levels(scope):
            bucket = self._local.get(key)
            if bucket is None:
                bucket = self._local[key] = Bucket(0.0, now)  # start empty: no burst on switch
            pairs.append((bucket, limit.share(parts)))
        return take_all(pairs, want, now)

    @staticmethod
    def _ttl_ms(levels: Sequence[tuple[str, Limit]]) -> int:
        longest = max(limit.burst / limit.qps for _, limit in levels)
        return int((longest * 2 + 60) * 1000)

    async def _heartbeat(self) -> None:
        """Every ``heartbeat_s``: announce this replica, count the live ones."""
        now = self.clock()
        if now - self._beat_at < self.config.heartbeat_s:
            return
        assert self.redis is not None
        wall = time.time()
        key = self.key("replicas")
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(key, {self.instance_id: wall + 3 * self.config.heartbeat_s})
        pipe.zremrangebyscore(key, "-inf", wall)
        pipe.zcard(key)
        pipe.expire(key, int(6 * self.config.heartbeat_s) + 1)
        result = await pipe.execute()
        self._divisor = max(1, int(result[2]))
        self._beat_at = now

    def _fall_back(self, exc: BaseException) -> None:
        self._retry_at = self.clock() + self.config.redis_retry_s
        if self.mode == "local":
            return
        self.mode = "local"
        self._local.clear()
        FALLBACK.set(1)
        FALLBACK_SWITCHES.labels("local").inc()
        log(
            logger,
            logging.WARNING,
            "rate limiter: Redis unavailable, local buckets",
            error=type(exc).__name__,
            share=f"1/{self.divisor}",
        )

    def _recover(self) -> None:
        self.mode = "redis"
        self._local.clear()
        FALLBACK.set(0)
        FALLBACK_SWITCHES.labels("redis").inc()
        log(logger, logging.INFO, "rate limiter: Redis is back")

    # -- 429 ------------------------------------------------------------------------------

    async def penalize(self, provider: str, seconds: float) -> None:
        """The provider said 429: no replica queries it for ``seconds``."""
        if seconds <= 0:
            return
        now = self.clock()
        self._holds[provider] = max(self._holds.get(provider, 0.0), now + seconds)
        if self.redis is None or self.mode == "local":
            return
        try:
            async with asyncio.timeout(self.config.redis_timeout_s):
                await self.redis.set(
                    self.key("hold", provider), "1", px=max(1, int(seconds * 1000)), nx=True
                )
        except REDIS_DOWN as exc:
            self._fall_back(exc)


# --- online interest -----------------------------------------------------------------------


def interest_key(
    kind: Literal["task", "project"], ident: object, prefix: str = INTEREST_PREFIX
) -> str:
    """``aivedio:interest:task:<task id>`` or ``aivedio:interest:project:<project id>``."""
    return f"{prefix}:{kind}:{ident}"


async def mark_interest(
    redis: aioredis.Redis,
    *,
    task_id: object | None = None,
    project_id: object | None = None,
    ttl_s: float = 30.0,
    prefix: str = INTEREST_PREFIX,
) -> None:
    """Someone is watching this task (or every task of this project) for ``ttl_s`` seconds.

    For the notification gateway: call it when a client subscribes and again every ``ttl_s/2``
    while the client stays; the key lapses by itself when it leaves. The poller polls watched
    tasks ``interest_factor`` times as often (still inside every rate limit)."""
    if task_id is None and project_id is None:
        raise ValueError("mark_interest needs a task_id or a project_id")
    targets: list[tuple[Literal["task", "project"], object]] = []
    if task_id is not None:
        targets.append(("task", task_id))
    if project_id is not None:
        targets.append(("project", project_id))
    await mark_interests(redis, targets, ttl_s=ttl_s, prefix=prefix)


async def mark_interests(
    redis: aioredis.Redis,
    targets: Iterable[tuple[Literal["task", "project"], object]],
    *,
    ttl_s: float = 30.0,
    prefix: str = INTEREST_PREFIX,
) -> None:
    """:func:`mark_interest` for many ``("task" | "project", id)`` targets in one pipeline (the
    gateway marks everything its streams watch at once)."""
    ttl_ms = max(1, int(ttl_s * 1000))
    pipe = redis.pipeline(transaction=False)
    for kind, ident in targets:
        pipe.set(interest_key(kind, ident, prefix), "1", px=ttl_ms)
    await pipe.execute()


async def watched(
    redis: aioredis.Redis | None,
    items: Iterable[tuple[object, object]],
    *,
    prefix: str = INTEREST_PREFIX,
    timeout_s: float = 0.25,
) -> set[str]:
    """The task ids (as strings) among ``(task_id, project_id)`` pairs that someone watches,
    directly or through their project. Empty when Redis does not answer: interest only ever
    makes polling sooner, so losing it is safe."""
    pairs = list(items)
    if redis is None or not pairs:
        return set()
    keys: list[str] = []
    for task_id, project_id in pairs:
        keys += [interest_key("task", task_id, prefix), interest_key("project", project_id, prefix)]
    try:
        async with asyncio.timeout(timeout_s):
            values = await redis.mget(keys)
    except REDIS_DOWN:
        return set()
    found: set[str] = set()
    for i, (task_id, _) in enumerate(pairs):
        if values[2 * i] is not None or values[2 * i + 1] is not None:
            found.add(str(task_id))
    return found


__all__ = [
    "INTEREST_PREFIX",
    "TAKE_SCRIPT",
    "RateLimiter",
    "Scope",
    "interest_key",
    "mark_interest",
    "mark_interests",
    "watched",
]
