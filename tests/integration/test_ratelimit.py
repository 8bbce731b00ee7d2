"""The rate limiter against real Redis: atomic four-level takes, holds, the local fallback when
Redis goes away (through a TCP proxy the test cuts), the way back, and the interest keys."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from aivedio.polling.buckets import Limit
from aivedio.polling.config import RateLimitConfig
from aivedio.polling.ratelimit import RateLimiter, Scope, mark_interest, watched
from tests.proxy import TcpProxy
from tests.waiting import eventually

SCOPE = Scope("sandbox", "m1", "tenant-a")


def limits(**kw: object) -> RateLimitConfig:
    base: dict[str, object] = {
        "prefix": f"test:rl:{uuid.uuid4().hex[:10]}",
        "global_limit": Limit(1000, 50),
        "providers": {"sandbox": Limit(1000, 50)},
        "tenant": Limit(1000, 50),
        "redis_timeout_s": 0.3,
        "redis_retry_s": 0.2,
    }
    base.update(kw)
    return RateLimitConfig(**base)  # type: ignore[arg-type]


def client(url: str) -> aioredis.Redis:
    return aioredis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = client(redis_url)
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[TcpProxy]:
    where = urlsplit(redis_url)
    p = TcpProxy(where.hostname or "127.0.0.1", where.port or 6379)
    await p.start()
    try:
        yield p
    finally:
        await p.cut()


def proxied(redis_url: str, proxy: TcpProxy) -> str:
    where = urlsplit(redis_url)
    return f"redis://127.0.0.1:{proxy.port}{where.path or '/0'}"


async def test_takes_from_all_four_buckets_or_none(redis: aioredis.Redis) -> None:
    cfg = limits(
        models={"sandbox/m1": Limit(1000, 50)},
        tenants={"tenant-a": Limit(0.001, 2)},
    )
    limiter = RateLimiter(redis, cfg)
    levels = limiter.levels(SCOPE)
    assert len(levels) == 4
    grant = await limiter.take(SCOPE, 5)
    assert grant.granted == 2  # the tenant bucket holds 2
    tokens = [float(await redis.hget(key, "t") or -1) for key, _ in levels]
    assert tokens[0] == pytest.approx(48, abs=0.5)  # global: 50 - 2 (+ a little refill)
    assert tokens[3] == pytest.approx(0, abs=0.01)
    denied = await limiter.take(SCOPE, 1)
    assert denied.granted == 0 and denied.wait_s > 100  # 1 token at 0.001/s
    after = [float(await redis.hget(key, "t") or -1) for key, _ in levels]
    assert after[0] == pytest.approx(tokens[0], abs=1)  # nothing taken from the others
    other = await limiter.take(Scope("sandbox", "m1", "tenant-b"), 3)
    assert other.granted == 3  # another tenant is not held back by tenant-a's bucket
    assert limiter.mode == "redis"


async def test_many_replicas_never_take_more_than_burst_plus_rate(
    redis: aioredis.Redis, redis_url: str
) -> None:
    """Twelve racing callers on three connections take no more than the burst plus what
    refilled, by Redis's own clock (the script's), from the shared provider bucket: exact token
    arithmetic, whatever the scheduler did with the callers meanwhile."""
    cfg = limits(providers={"sandbox": Limit(50, 5)})
    clients = [client(redis_url) for _ in range(3)]
    limiters = [RateLimiter(c, cfg) for c in clients]
    granted = 0
    seconds, micros = await redis.time()
    before = seconds + micros / 1_000_000  # at or before the first take's clock

    async def hammer(limiter: RateLimiter) -> None:
        nonlocal granted
        for _ in range(25):
            grant = await limiter.take(SCOPE, 3)
            granted += grant.granted
            await asyncio.sleep(0.005 if grant.granted else min(grant.wait_s, 0.05))

    try:
        await asyncio.gather(*(hammer(limiters[i % 3]) for i in range(12)))
    finally:
        for c in clients:
            await c.aclose()
    [provider_key] = [key for key, limit in limiters[0].levels(SCOPE) if limit == Limit(50, 5)]
    left, stamp = (float(v or "nan") for v in await redis.hmget(provider_key, "t", "s"))
    # Every grant took from this bucket; it held 5 at ``before`` and refilled 50/s up to
    # ``stamp``, its last take (refill lost while it was full only lowers the sum).
    assert granted + left <= 5 + 50 * (stamp - before) + 1e-3
    assert granted >= 5  # it does grant


async def test_a_429_hold_stops_every_replica(redis: aioredis.Redis, redis_url: str) -> None:
    cfg = limits()
    first = RateLimiter(redis, cfg)
    other_client = client(redis_url)
    try:
        second = RateLimiter(other_client, cfg)
        await first.penalize("sandbox", 2.0)
        grant = await second.take(SCOPE, 1)
        assert grant.granted == 0 and 0 < grant.wait_s <= 2.0
        assert (await second.take(Scope("other", "m", "t"), 1)).granted == 1
    finally:
        await other_client.aclose()


class FakeClock:
    """The limiter's clock (its local buckets, retries and heartbeats), moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_local_fallback_starts_empty_is_shared_and_recovers(
    redis_url: str, proxy: TcpProxy
) -> None:
    cfg = limits(providers={"sandbox": Limit(60, 6)}, replicas=3, redis_retry_s=3600.0)
    clock = FakeClock()
    r = client(proxied(redis_url, proxy))
    try:
        limiter = RateLimiter(r, cfg, clock=clock)
        assert (await limiter.take(SCOPE, 1)).granted == 1
        assert limiter.mode == "redis"
        await proxy.cut()
        grant = await limiter.take(SCOPE, 10)
        assert limiter.mode == "local"
        assert grant.granted == 0  # empty on the switch: no burst
        assert grant.wait_s == pytest.approx(3 / 60, rel=0.1)  # 1 token at 60/3 per second
        # A third of 60/s, burst 2: half a second in steps of 10 ms refills 10 tokens ...
        switched, total = clock.now, 0
        for step in range(1, 51):
            clock.now = switched + step / 100
            total += (await limiter.take(SCOPE, 5)).granted
        assert total == 10
        clock.now += 60  # ... and a minute without takes banks no more than the burst
        assert (await limiter.take(SCOPE, 5)).granted == 2
        assert limiter.mode == "local"  # no retry of Redis before redis_retry_s
        await proxy.start()  # Redis is back

        async def back_on_redis() -> bool:
            clock.now += cfg.redis_retry_s  # the next try is due
            await limiter.take(SCOPE, 1)
            return limiter.mode == "redis"

        await eventually(back_on_redis, "the limiter to go back to Redis", interval=0.05)
    finally:
        await r.aclose()


async def test_no_redis_at_all_is_local_mode(redis_url: str) -> None:
    clock = FakeClock()
    r = aioredis.from_url("redis://127.0.0.1:1/0", socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        cfg = limits(providers={"sandbox": Limit(100, 5)}, replicas=2)
        limiter = RateLimiter(r, cfg, clock=clock)
        assert (await limiter.take(SCOPE, 1)).granted == 0
        assert limiter.mode == "local"
        clock.now += 0.1  # 5 tokens at 100/2 per second, more than the burst of 5/2
        assert (await limiter.take(SCOPE, 10)).granted == 2
        assert limiter.divisor == 2
    finally:
        await r.aclose()


async def test_replicas_seen_in_redis_widen_the_fallback_divisor(redis_url: str) -> None:
    cfg = limits(replicas=1, heartbeat_s=5.0)  # a beat counts for 15 s
    clock = FakeClock()
    clients = [client(redis_url) for _ in range(3)]
    try:
        limiters = [RateLimiter(c, cfg, clock=clock) for c in clients]
        for limiter in limiters:
            await limiter.take(SCOPE, 1)
        assert limiters[0].divisor == 1  # it beat first, alone
        clock.now += cfg.heartbeat_s  # the next beat is due
        await limiters[0].take(SCOPE, 1)
        assert limiters[0].divisor == 3
    finally:
        for c in clients:
            await c.aclose()


async def test_interest_keys(redis: aioredis.Redis) -> None:
    prefix = f"test:interest:{uuid.uuid4().hex[:8]}"
    t1, t2, t3, p1, p2 = (uuid.uuid4() for _ in range(5))
    await mark_interest(redis, task_id=t1, ttl_s=5, prefix=prefix)
    await mark_interest(redis, project_id=p2, ttl_s=5, prefix=prefix)
    await mark_interest(redis, task_id=t3, ttl_s=0.2, prefix=prefix)
    assert await redis.exists(f"{prefix}:task:{t1}") == 1
    seen = await watched(redis, [(t1, p1), (t2, p2), (t3, p1)], prefix=prefix)
    assert seen == {str(t1), str(t2), str(t3)}

    async def lapsed() -> bool:
        return str(t3) not in await watched(redis, [(t3, p1)], prefix=prefix)

    await eventually(lapsed, "the short interest to lapse")
    assert await watched(None, [(t1, p1)], prefix=prefix) == set()
    with pytest.raises(ValueError, match="task_id or a project_id"):
        await mark_interest(redis)
