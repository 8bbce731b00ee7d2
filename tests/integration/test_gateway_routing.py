"""Node-directed fan-out: gateway nodes register project -> node routes in Redis, the dispatcher's
router publishes each event only to the channels of interested nodes. Routes are hints: stale or
missing entries cost latency (the early tail check, the periodic one), never an event."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from aivedio.channels import broadcast_channel, node_channel, routes_changed_channel, routes_key
from aivedio.config import Settings
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderStatus
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.routing import NodeRoutes
from aivedio.propagation.routing import NodeRouter, RouterConfig
from tests.integration.propagation import Subscriber, running
from tests.integration.test_gateway_chaos import (
    all_delivered,
    final_statuses,
    gateway_overrides,
    open_readers,
    real_chain,
    routed_to,
)
from tests.integration.test_gateway_harness import Env, EnvFactory, make_env
from tests.waiting import eventually, eventually_sync

__all__ = ["make_env"]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    return f"troute{uuid.uuid4().hex[:8]}"


# -- the registry and the router --------------------------------------------------------------


async def announcements_heard(redis: Redis, prefix: str) -> None:
    """Wait until a router's subscription to the route announcements is up (Redis counts it)."""
    channel = routes_changed_channel(prefix)

    async def subscribed() -> bool:
        [(_, count)] = await redis.pubsub_numsub(channel)
        return int(count) >= 1

    await eventually(subscribed, "the announcement subscription", 10)


async def test_a_registration_is_seen_by_the_router_at_once_and_a_leave_removes_it(
    redis: Redis, prefix: str
) -> None:
    router = NodeRouter(redis, RouterConfig(prefix=prefix, refresh_s=3600))  # announcements only
    registered: list[list[uuid.UUID]] = []
    routes = NodeRoutes(redis, prefix, "node-a", ttl_s=30, on_registered=registered.append)
    project = uuid.uuid4()
    async with running(router.run, routes.run):
        await asyncio.wait_for(router.ready.wait(), 5)
        await announcements_heard(redis, prefix)
        assert router.channels(str(project)) == ()
        routes.add(project)
        await eventually(
            lambda: router.channels(str(project)) == (node_channel(prefix, "node-a"),),
            "the route is announced",
        )
        await eventually(lambda: registered == [[project]], "told the gateway (early check)")
        score = await redis.zscore(routes_key(prefix), f"{project}:node-a")
        assert score is not None and 25_000 < score - time.time() * 1000 <= 30_000
        routes.discard(project)
        await eventually(lambda: router.channels(str(project)) == (), "the leave is announced")
        assert await redis.zscore(routes_key(prefix), f"{project}:node-a") is None


async def test_a_router_started_later_reads_the_registry_and_shutdown_unregisters(
    redis: Redis, prefix: str
) -> None:
    routes = NodeRoutes(redis, prefix, "node-b", ttl_s=30)
    projects = [uuid.uuid4() for _ in range(3)]
    stopping = asyncio.Event()
    job = asyncio.create_task(routes.run(stopping))
    for project in projects:
        routes.add(project)
    await eventually(lambda: routes.projects and not routes._dirty, "written")

    async def all_written() -> bool:
        return await redis.zcard(routes_key(prefix)) == 3

    await eventually(all_written, "the three routes in the registry")

    router = NodeRouter(redis, RouterConfig(prefix=prefix, refresh_s=3600))
    async with running(router.run):
        await asyncio.wait_for(router.ready.wait(), 5)
        for project in projects:
            assert router.channels(str(project)) == (node_channel(prefix, "node-b"),)
        await announcements_heard(redis, prefix)
        stopping.set()  # a graceful stop removes and announces every route of the node
        await asyncio.wait_for(job, 10)
        await eventually(
            lambda: all(router.channels(str(p)) == () for p in projects), "unregistered"
        )
    assert await redis.zcard(routes_key(prefix)) == 0


async def test_a_dead_nodes_entry_lapses_by_its_own_expiry(redis: Redis, prefix: str) -> None:
    project = uuid.uuid4()
    expiry_ms = int((time.time() + 1.0) * 1000)
    await redis.zadd(routes_key(prefix), {f"{project}:dead": expiry_ms, f"{project}:alive": 9e15})
    router = NodeRouter(redis, RouterConfig(prefix=prefix, refresh_s=3600))
    async with running(router.run):
        await asyncio.wait_for(router.ready.wait(), 5)
        dead, alive = node_channel(prefix, "dead"), node_channel(prefix, "alive")
        assert router.channels(str(project)) == (alive, dead)
        await eventually(lambda: router.channels(str(project)) == (alive,), "lapsed", 5)
        # A removal the router did not hear about (lost announcement) changes nothing until the
        # entry's expiry; a malformed announcement is ignored.
        await redis.publish(routes_changed_channel(prefix), "garbage\n+x:y not-a-number")
        await asyncio.sleep(0.2)
        assert router.channels(str(project)) == (alive,)


# -- gateways on the real chain -----------------------------------------------------------------


async def node_env(
    make_env: EnvFactory, redis_url: str, prefix: str, node: str, route_ttl_s: float = 3.0
) -> Env:
    return await make_env(
        publish=False,
        route_ttl_s=route_ttl_s,
        **gateway_overrides(prefix, redis_url, "node", node),
    )


def received_at_least(watcher: Subscriber, count: int) -> Callable[[], bool]:
    return lambda: len(watcher.received) >= count


async def finish_tasks(env: Env, count: int) -> None:
    for _ in range(count):
        _, attempt = await env.new_task()
        await env.provider(attempt, ProviderStatus.RUNNING, progress=40)
        await env.provider(attempt, ProviderStatus.FAILED, error_code="content_rejected")


async def test_stale_routing_entries_lose_nothing(
    make_env: EnvFactory,
    db: Database,
    nats_url: str,
    redis_url: str,
    redis: Redis,
    prefix: str,
) -> None:
    # Routes refreshed every 5 s: the lost entry below stays lost for a while.
    env = await node_env(make_env, redis_url, prefix, "live", route_ttl_s=15.0)
    project = str(env.project.project_id)
    live, dead = node_channel(prefix, "live"), node_channel(prefix, "dead")
    dead_channel = Subscriber(redis, dead)
    await dead_channel.start()
    async with real_chain(db, nats_url, redis_url, prefix, node=True) as router:
        assert router is not None
        readers = await open_readers(env)
        await routed_to(router, env, (live,))

        # A node that registered for this project and died: its entry lives until it lapses.
        expiry = int((time.time() + 60) * 1000)
        await redis.zadd(routes_key(prefix), {f"{project}:dead": expiry})
        await redis.publish(routes_changed_channel(prefix), f"+{project}:dead {expiry}")
        await routed_to(router, env, (dead, live))
        await finish_tasks(env, 3)
        _, head = await env.head()
        await all_delivered(readers, head, 10)
        await dead_channel.wait_for(lambda: len(dead_channel.received) >= head)

        # This node's own entry lost behind its back (as if it had lapsed): events go only to
        # the dead node's channel, and the tail check still delivers all of them.
        await redis.zrem(routes_key(prefix), f"{project}:live")
        await redis.publish(routes_changed_channel(prefix), f"-{project}:live")
        await routed_to(router, env, (dead,))
        await finish_tasks(env, 3)
        _, head = await env.head()
        await all_delivered(readers, head, 5.0)
        for reader in readers:
            assert set(final_statuses(reader).values()) == {"failed"}

        # The node refreshes its routes (every route_ttl_s / 3) and the router's full read
        # (refresh_s) finds the entry again: routing heals by itself.
        await routed_to(router, env, (dead, live), seconds=15)
        for reader in readers:
            await reader.stop()
    await dead_channel.stop()


async def test_two_nodes_receive_only_their_projects_on_their_own_channels(
    make_env: EnvFactory,
    db: Database,
    nats_url: str,
    redis_url: str,
    redis: Redis,
    prefix: str,
) -> None:
    envs = [
        await node_env(make_env, redis_url, prefix, "one"),
        await node_env(make_env, redis_url, prefix, "two"),
    ]
    channels = [node_channel(prefix, "one"), node_channel(prefix, "two")]
    for env, channel in zip(envs, channels, strict=True):
        assert env.gateway.hub.channel == channel  # nothing but its node channel
    numsub = dict(await redis.pubsub_numsub(broadcast_channel(prefix), *channels))
    assert numsub == {broadcast_channel(prefix).encode(): 0} | {c.encode(): 1 for c in channels}
    watchers = [Subscriber(redis, channel) for channel in channels]
    for watcher in watchers:
        await watcher.start()
    async with real_chain(db, nats_url, redis_url, prefix, node=True) as router:
        assert router is not None
        readers = [await open_readers(env, ("sse", "ws")) for env in envs]
        for env, channel in zip(envs, channels, strict=True):
            await routed_to(router, env, (channel,))
        for env in envs:
            await finish_tasks(env, 3)
        for env, env_readers in zip(envs, readers, strict=True):
            _, head = await env.head()
            await all_delivered(env_readers, head, 10)
        for env, watcher in zip(envs, watchers, strict=True):
            _, head = await env.head()
            await watcher.wait_for(received_at_least(watcher, head))
            projects = {m["project_id"] for m in watcher.received}
            assert projects == {str(env.project.project_id)}
        for env_readers in readers:
            for reader in env_readers:
                await reader.stop()
    for watcher in watchers:
        await watcher.stop()


async def test_events_routed_before_the_dispatcher_learned_the_route_arrive_by_the_early_check(
    make_env: EnvFactory, redis_url: str, prefix: str
) -> None:
    # No dispatcher at all (as if it had not heard of this node's route yet), and a periodic
    # tail check far away: only the early check after the registration can deliver.
    env = await make_env(
        publish=False,
        tailcheck_s=120.0,
        route_check_delay_s=2.0,
        **gateway_overrides(prefix, redis_url, "node", "racer"),
    )
    readers = await open_readers(env, ("sse", "ws"))
    await asyncio.sleep(0.3)  # past the position read: these events are not part of the replay
    for _ in range(3):
        await env.new_task()
    _, head = await env.head()
    await all_delivered(readers, head, 15)
    for reader in readers:
        await reader.stop()


def test_settings_select_the_fanout() -> None:
    settings = Settings(fanout="node", gateway_node_id="gw-1", secret_key="k" * 32)
    config = GatewayConfig.from_settings(settings, "redis://127.0.0.1:1/0")
    assert (config.fanout, config.node_id) == ("node", "gw-1")
    assert (
        GatewayConfig.from_settings(Settings(secret_key="k" * 32), "redis://x").fanout
        == "broadcast"
    )
    with pytest.raises(ValidationError):
        Settings(fanout="everywhere")


def test_the_router_map_follows_announcements_and_expiries() -> None:
    router = NodeRouter(Redis.from_url("redis://127.0.0.1:1/0"), RouterConfig(prefix="p"))
    soon, later = int((time.time() + 1.0) * 1000), int((time.time() + 60) * 1000)
    router.apply(f"+proj-1:b {later}\n+proj-1:a {soon}\n+proj-2:a {later}")
    assert router.channels("proj-1") == ("p:node:a", "p:node:b")
    assert router.channels("proj-2") == ("p:node:a",)
    router.apply(f"+proj-1:a {soon - 100_000}")  # an older expiry never shortens an entry
    assert router.channels("proj-1") == ("p:node:a", "p:node:b")
    router.apply("-proj-2:a")
    assert router.channels("proj-2") == ()
    assert router.channels("never-seen") == ()
    eventually_sync(lambda: router.channels("proj-1") == ("p:node:b",), "node a's entry to lapse")
    router.prune()
    assert set(router._nodes) == {"proj-1"} and set(router._cache) <= {"proj-1"}
