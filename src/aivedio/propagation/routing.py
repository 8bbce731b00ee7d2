"""Node-directed fan-out, the dispatcher's side: which gateway nodes want a project's events.

The gateway nodes register ``project -> node`` routes in Redis (:mod:`aivedio.gateway.routing`,
names in :mod:`aivedio.channels`). The dispatcher's :class:`NodeRouter` is the synchronous
``router`` of :class:`~aivedio.propagation.dispatcher.NotificationDispatcher`: it answers from a
local map
``project -> {node: expiry}``, fed by the change announcements and by a full read of the set at
start, after every (re)subscribe and every ``refresh_s``. A full read adds and extends entries;
entries disappear by a ``-`` announcement or when their own expiry passes, so a Redis restart
(which empties the set until the gateways re-register) does not interrupt routing. The
announcements arrive by the fan-out port (:mod:`aivedio.fanout`: Redis Pub/Sub on the router's
client unless another subscriber is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import cast

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis
from redis.exceptions import RedisError

from aivedio.bus.port import BusConfig
from aivedio.channels import DEFAULT_PREFIX, node_channel, routes_changed_channel, routes_key
from aivedio.db.wakeup import wait_any
from aivedio.fanout import FanoutError, FanoutSubscriber, Message, Subscribed
from aivedio.fanout.redis import RedisFanout
from aivedio.logs import log
from aivedio.process.parts import RoleParts
from aivedio.propagation.dispatcher import DispatcherConfig, RoutedEvent
from aivedio.propagation.roles import dispatcher_role
from aivedio.runtime import Runtime

__all__ = ["NodeRouter", "RouterConfig", "node_dispatcher_role", "node_router"]

logger = logging.getLogger("aivedio.propagation")

REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

ROUTED_PROJECTS = Gauge(
    "aivedio_dispatch_routed_projects", "Projects the node router knows an interested node of"
)
UNROUTED = Counter(
    "aivedio_dispatch_unrouted_events_total",
    "Events no gateway node had registered interest in (published nowhere)",
)
ROUTE_REFRESHES = Counter(
    "aivedio_dispatch_route_refreshes_total",
    "Full reads of the route registry, by outcome",
    ["outcome"],
)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _wait(event: asyncio.Event, stopping: asyncio.Event, seconds: float) -> None:
    """Until ``event`` or ``stopping`` is set, or ``seconds`` passed."""
    await wait_any(stopping, max(0.0, seconds), event)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefix: str = DEFAULT_PREFIX  # the dispatcher's ``channel_prefix``; gateways use the same
    refresh_s: float = 5.0  # full read of the registry at this interval
    timeout_s: float = 2.0
    ready_timeout_s: float = 5.0  # the dispatcher waits this long for the first full read


class NodeRouter:
    """``project -> node channels`` for the dispatcher, answered from a local map (synchronous,
    called per event inside the publish pipeline); ``run`` keeps the map fresh."""

    def __init__(
        self,
        redis: Redis,
        config: RouterConfig | None = None,
        *,
        fanout: FanoutSubscriber | None = None,
    ) -> None:
        self.redis = redis  # the route registry (a sorted set)
        self.fanout = fanout if fanout is not None else RedisFanout(redis)  # its announcements
        self.config = config or RouterConfig()
        self.ready = asyncio.Event()  # set after the first full read
        self._nodes: dict[str, dict[str, float]] = {}  # project -> node -> expiry (unix s)
        self._cache: dict[str, tuple[tuple[str, ...], float]] = {}  # channels, earliest expiry
        self._refresh_now = asyncio.Event()

    # -- the router ---------------------------------------------------------------------------

    def __call__(self, event: RoutedEvent) -> Sequence[str]:
        return self.channels(event.project_id)

    def channels(self, project_id: str) -> tuple[str, ...]:
        cached = self._cache.get(project_id)
        now = time.time()
        if cached is None or now >= cached[1]:
            cached = self._build(project_id, now)
        if not cached[0]:
            UNROUTED.inc()
        return cached[0]

    def _build(self, project_id: str, now: float) -> tuple[tuple[str, ...], float]:
        nodes = self._nodes.get(project_id)
        if nodes is not None:
            for node in [n for n, expiry in nodes.items() if expiry <= now]:
                del nodes[node]
            if not nodes:
                del self._nodes[project_id]
                nodes = None
        if nodes is None:  # not cached: unrouted projects must not accumulate
            self._cache.pop(project_id, None)
            return ((), 0.0)
        prefix = self.config.prefix
        entry = (tuple(sorted(node_channel(prefix, n) for n in nodes)), min(nodes.values()))
        self._cache[project_id] = entry
        return entry

    def prune(self) -> None:
        """Forget lapsed entries of projects that had no event since (after each full read)."""
        now = time.time()
        for project_id in list(self._nodes):
            self._build(project_id, now)

    # -- keeping the map fresh ----------------------------------------------------------------

    def _set(self, project_id: str, node: str, expiry_s: float) -> None:
        nodes = self._nodes.setdefault(project_id, {})
        if expiry_s > nodes.get(node, 0.0):
            nodes[node] = expiry_s
            self._cache.pop(project_id, None)

    def _remove(self, project_id: str, node: str) -> None:
        nodes = self._nodes.get(project_id)
        if nodes is not None and nodes.pop(node, None) is not None:
            if not nodes:
                del self._nodes[project_id]
            self._cache.pop(project_id, None)

    def apply(self, text: str) -> None:
        """Lines of a ``routes:changed`` announcement."""
        for line in text.splitlines():
            try:
                if line.startswith("+"):
                    member, _, expiry = line[1:].partition(" ")
                    project, _, node = member.partition(":")
                    self._set(project, node, int(expiry) / 1000)
                elif line.startswith("-"):
                    project, _, node = line[1:].partition(":")
                    self._remove(project, node)
            except ValueError:
                log(logger, logging.WARNING, "unreadable route announcement", line=line[:200])

    async def refresh(self) -> int:
        """Read every live registration; returns how many there were."""
        now = _now_ms()
        async with asyncio.timeout(self.config.timeout_s):
            rows = cast(
                "list[tuple[bytes | str, float]]",
                await self.redis.zrangebyscore(
                    routes_key(self.config.prefix), now, "+inf", withscores=True
                ),
            )
        for member, score in rows:
            text = member.decode() if isinstance(member, bytes) else str(member)
            project, _, node = text.partition(":")
            if node:
                self._set(project, node, float(score) / 1000)
        self.prune()
        ROUTED_PROJECTS.set(len(self._nodes))
        return len(rows)

    async def run(self, stopping: asyncio.Event) -> None:
        refresher = asyncio.create_task(self._refresh_loop(stopping))
        try:
            await self._listen(stopping)
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher

    async def _refresh_loop(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            self._refresh_now.clear()  # a request made during the read below reads again
            try:
                await self.refresh()
                ROUTE_REFRESHES.labels("ok").inc()
                self.ready.set()
                wait = self.config.refresh_s
            except REDIS_DOWN as exc:
                ROUTE_REFRESHES.labels("failed").inc()
                log(logger, logging.WARNING, "route registry unreadable", error=repr(exc))
                wait = min(1.0, self.config.refresh_s)
            await _wait(self._refresh_now, stopping, wait)

    async def _listen(self, stopping: asyncio.Event) -> None:
        """Follow the announcements; after every (re)subscribe, read everything again."""
        backoff = 0.1
        channel = routes_changed_channel(self.config.prefix)
        while not stopping.is_set():
            subscription = self.fanout.subscription()
            try:
                await subscription.subscribe(channel)
                while not stopping.is_set():
                    event = await subscription.next(timeout=1.0)
                    if isinstance(event, Subscribed):
                        self._refresh_now.set()  # announcements may have been missed
                        backoff = 0.1
                    elif isinstance(event, Message):
                        self.apply(event.data.decode(errors="replace"))
            except FanoutError as exc:
                log(logger, logging.WARNING, "route announcements lost", error=repr(exc))
                await _wait(asyncio.Event(), stopping, random.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)
            finally:
                await subscription.close()


@contextlib.asynccontextmanager
async def node_router(
    client: Redis, stopping: asyncio.Event, config: RouterConfig
) -> AsyncIterator[NodeRouter]:
    """A running :class:`NodeRouter` (for ``dispatcher_role(router=...)``): started, given up to
    ``ready_timeout_s`` for its first full read (unrouted events are repaired anyway), stopped
    when the dispatcher stops."""
    router = NodeRouter(client, config)
    routing = asyncio.create_task(router.run(stopping))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(router.ready.wait(), config.ready_timeout_s)
        yield router
    finally:
        routing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await routing


async def node_dispatcher_role(
    rt: Runtime,
    *,
    config: DispatcherConfig | None = None,
    router_config: RouterConfig | None = None,
) -> RoleParts:
    """The ``dispatcher`` role with node-directed fan-out (``AIVEDIO_FANOUT=node``)."""
    bus_cfg = BusConfig.from_settings(rt.settings, rt.urls.nats_url, rt.urls.redis_url)
    cfg = config or DispatcherConfig(max_deliver=bus_cfg.max_deliver)
    rcfg = router_config or RouterConfig(prefix=cfg.channel_prefix)
    return await dispatcher_role(
        rt, bus_config=bus_cfg, config=cfg, router=functools.partial(node_router, config=rcfg)
    )
