"""Node-directed fan-out and online interest: what this gateway node watches, told to Redis.

Two registries, both hints that correctness never depends on (gap repair and the tail check
recover any message a stale or missing entry costs):

**Routes** (``AIVEDIO_FANOUT=node``). Every gateway node has an id and its own Pub/Sub channel
``<prefix>:node:<id>``. It registers ``project -> node`` interest in ONE sorted set
``<prefix>:routes`` (member ``<project_id>:<node_id>``, score = expiry in unix ms) while it has a
stream of that project, refreshes the scores every ``route_ttl_s / 3`` and removes the member when
the last stream of the project leaves (and all of its members on shutdown). Every change is also
announced on ``<prefix>:routes:changed`` (lines ``+<project>:<node> <expiry_ms>`` /
``-<project>:<node>``), so a dispatcher sees a new registration within milliseconds.

The dispatcher's :class:`NodeRouter` is the synchronous ``router`` of
:class:`~aivedio.propagation.dispatcher.NotificationDispatcher`: it answers from a local map
``project -> {node: expiry}``, fed by the change announcements and by a full read of the set at
start, after every (re)subscribe and every ``refresh_s``. A full read adds and extends entries;
entries disappear by a ``-`` announcement or when their own expiry passes, so a Redis restart
(which empties the set until the gateways re-register) does not interrupt routing.

A registration race (an event published before the dispatcher learned the route) costs one
message: the gateway runs an early tail check ``route_check_delay_s`` (1 s) after every
successful registration. A node that died leaves entries that lapse after ``route_ttl_s``;
publishing to a channel nobody reads costs nothing else.

**Polling interest** (both modes). While a node has a stream of a project without a task filter
it marks the project, and for a ``?task_id=`` (or WebSocket ``subscribe``) stream it marks the
task, with the keys and TTL of :func:`aivedio.polling.ratelimit.mark_interest`; the poller polls
watched tasks sooner. New targets are marked at once (one pipeline per batch), everything is
re-marked every ``interest_ttl_s / 2`` by one shared loop, not a timer per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis
from redis.exceptions import RedisError

from aivedio.bus.port import BusConfig
from aivedio.channels import INTEREST_PREFIX, node_channel, routes_changed_channel, routes_key
from aivedio.logs import log
from aivedio.polling.ratelimit import mark_interests
from aivedio.process.parts import RoleParts
from aivedio.runtime import Runtime

if TYPE_CHECKING:
    from aivedio.propagation.dispatcher import DispatcherConfig, RoutedEvent

__all__ = [
    "InterestMarks",
    "NodeRouter",
    "NodeRoutes",
    "RouterConfig",
    "new_node_id",
    "node_channel",
    "node_dispatcher_role",
    "node_router",
    "routes_changed_channel",
    "routes_key",
]

logger = logging.getLogger("aivedio.gateway")

REDIS_DOWN: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

ROUTE_WRITES = Counter(
    "aivedio_gateway_route_writes_total",
    "Route registry writes of this gateway node, by outcome (ok, failed)",
    ["outcome"],
)
INTEREST_WRITES = Counter(
    "aivedio_gateway_interest_writes_total",
    "Polling-interest writes of this gateway node, by outcome (ok, failed)",
    ["outcome"],
)
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

_NODE_ID = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def new_node_id() -> str:
    """``<host>-<pid>-<random>``: unique per process start, readable in ``PUBSUB CHANNELS``."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "node"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def check_node_id(node_id: str) -> str:
    if not _NODE_ID.match(node_id):
        raise ValueError(f"a node id is 1-100 of [A-Za-z0-9._-], got {node_id!r}")
    return node_id


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _wait(event: asyncio.Event, stopping: asyncio.Event, seconds: float) -> None:
    """Until ``event`` or ``stopping`` is set, or ``seconds`` passed."""
    waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopping.wait())]
    try:
        await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


# -- gateway side: this node's routes -----------------------------------------------------------


class NodeRoutes:
    """This node's ``project -> node`` registrations (node fan-out only).

    ``add``/``discard`` are synchronous (called by the hub when a project's first stream opens
    and its last one closes); one background loop writes the changes in one pipeline per batch,
    refreshes every registration each ``ttl_s / 3``, and retries with backoff while Redis is
    away. ``on_registered`` receives the projects of every successful write that (re)registered
    them (the gateway schedules an early tail check for them).
    """

    def __init__(
        self,
        redis: Redis,
        prefix: str,
        node_id: str,
        ttl_s: float = 30.0,
        timeout_s: float = 2.0,
        on_registered: Callable[[list[uuid.UUID]], None] = lambda _ids: None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.node_id = check_node_id(node_id)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.on_registered = on_registered
        self.projects: set[uuid.UUID] = set()
        self._dirty: set[uuid.UUID] = set()
        self._everything = False  # re-register and announce all (after a Redis reconnect)
        self._wake = asyncio.Event()

    def member(self, project_id: uuid.UUID | str) -> str:
        return f"{project_id}:{self.node_id}"

    def add(self, project_id: uuid.UUID) -> None:
        self.projects.add(project_id)
        self._dirty.add(project_id)
        self._wake.set()

    def discard(self, project_id: uuid.UUID) -> None:
        self.projects.discard(project_id)
        self._dirty.add(project_id)
        self._wake.set()

    def reregister(self) -> None:
        """Write and announce every registration again (Redis may have restarted empty)."""
        self._everything = True
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        refresh_s = self.ttl_s / 3
        next_refresh = time.monotonic() + refresh_s
        backoff = 0.25
        try:
            while not stopping.is_set():
                await _wait(self._wake, stopping, next_refresh - time.monotonic())
                if stopping.is_set():
                    break
                self._wake.clear()
                periodic = time.monotonic() >= next_refresh
                if await self.flush(periodic):
                    backoff = 0.25
                    if periodic:
                        next_refresh = time.monotonic() + refresh_s
                else:
                    await _wait(asyncio.Event(), stopping, random.uniform(backoff / 2, backoff))
                    backoff = min(backoff * 2, 5.0)
                    self._wake.set()  # retry what is still dirty
        finally:
            await self.unregister_all()

    async def flush(self, periodic: bool = False) -> bool:
        """Write what changed (and, ``periodic``, refresh everything); ``False``: Redis failed
        and the changes stay queued."""
        dirty, self._dirty = self._dirty, set()
        everything, self._everything = self._everything, False
        added = [p for p in dirty if p in self.projects]
        removed = [p for p in dirty if p not in self.projects]
        announce = list(self.projects) if everything else added
        write = list(self.projects) if (everything or periodic) else added
        if not write and not removed:
            return True
        now = _now_ms()
        expiry = now + int(self.ttl_s * 1000)
        key = routes_key(self.prefix)
        lines = [f"+{self.member(p)} {expiry}" for p in announce]
        lines += [f"-{self.member(p)}" for p in removed]
        pipe = self.redis.pipeline(transaction=False)
        if write:
            pipe.zadd(key, {self.member(p): expiry for p in write})
        if removed:
            pipe.zrem(key, *(self.member(p) for p in removed))
        if periodic:
            pipe.zremrangebyscore(key, "-inf", now)  # anyone's lapsed entries (dead nodes)
        if lines:
            pipe.publish(routes_changed_channel(self.prefix), "\n".join(lines))
        try:
            async with asyncio.timeout(self.timeout_s):
                await pipe.execute()
        except REDIS_DOWN as exc:
            ROUTE_WRITES.labels("failed").inc()
            log(logger, logging.WARNING, "route registry unavailable", error=repr(exc))
            self._dirty |= dirty
            self._everything |= everything
            return False
        ROUTE_WRITES.labels("ok").inc()
        registered = [p for p in announce if p in self.projects]
        if registered:
            self.on_registered(registered)
        return True

    async def unregister_all(self) -> None:
        """On shutdown: remove and announce every registration of this node (best effort; what
        is left lapses after the TTL)."""
        members = [self.member(p) for p in self.projects | self._dirty]
        if not members:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(routes_key(self.prefix), *members)
        pipe.publish(routes_changed_channel(self.prefix), "\n".join(f"-{m}" for m in members))
        with contextlib.suppress(*REDIS_DOWN):
            async with asyncio.timeout(self.timeout_s):
                await pipe.execute()


# -- gateway side: polling interest -------------------------------------------------------------

Target = tuple[Literal["task", "project"], str]


class InterestMarks:
    """Marks what this node's clients watch, for the poller (both fan-out modes).

    ``targets`` returns the current set (one per unfiltered project stream, one per task filter);
    ``note`` is called when a session subscribes or changes its filter: a target not marked yet
    is marked at once (batched), and every ``ttl_s / 2`` all current targets are re-marked in one
    pipeline. Targets nobody watches any more are simply not refreshed: their keys lapse.
    """

    def __init__(
        self,
        redis: Redis,
        targets: Callable[[], Iterable[Target]],
        ttl_s: float = 30.0,
        prefix: str = INTEREST_PREFIX,
        timeout_s: float = 2.0,
    ) -> None:
        self.redis = redis
        self.targets = targets
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.marked: set[Target] = set()  # marked in the current period
        self._new: set[Target] = set()
        self._everything = False
        self._wake = asyncio.Event()

    def note(self, target: Target | None) -> None:
        if target is None or target in self.marked or target in self._new:
            return
        self._new.add(target)
        self._wake.set()

    def remark(self) -> None:
        """Mark everything now (Redis may have restarted empty)."""
        self._everything = True
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        period = self.ttl_s / 2
        next_all = time.monotonic() + period
        while not stopping.is_set():
            await _wait(self._wake, stopping, next_all - time.monotonic())
            if stopping.is_set():
                return
            self._wake.clear()
            everything = self._everything or time.monotonic() >= next_all
            self._everything = False
            if everything:
                targets = set(self.targets())
                self._new.clear()
                next_all = time.monotonic() + period
                if await self._mark(targets):
                    self.marked = targets
                else:
                    self.marked = set()
                    next_all = time.monotonic() + min(period, 2.0)  # retry soon
            else:
                new, self._new = self._new, set()
                if await self._mark(new):
                    self.marked |= new
                # else: the next periodic pass marks them

    async def _mark(self, targets: set[Target]) -> bool:
        """Every target in one pipeline (``mark_interests``, the poller's own key writer)."""
        if not targets:
            return True
        try:
            async with asyncio.timeout(self.timeout_s):
                await mark_interests(self.redis, targets, ttl_s=self.ttl_s, prefix=self.prefix)
        except REDIS_DOWN as exc:
            INTEREST_WRITES.labels("failed").inc()
            log(logger, logging.WARNING, "interest marks unavailable", error=repr(exc))
            return False
        INTEREST_WRITES.labels("ok").inc()
        return True


# -- dispatcher side ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefix: str = "aivedio"  # the dispatcher's ``channel_prefix``; gateways use the same
    refresh_s: float = 5.0  # full read of the registry at this interval
    timeout_s: float = 2.0
    ready_timeout_s: float = 5.0  # the dispatcher waits this long for the first full read


class NodeRouter:
    """``project -> node channels`` for the dispatcher, answered from a local map (synchronous,
    called per event inside the publish pipeline); ``run`` keeps the map fresh."""

    def __init__(self, redis: Redis, config: RouterConfig | None = None) -> None:
        self.redis = redis
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
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                while not stopping.is_set():
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self._refresh_now.set()  # announcements may have been missed
                        backoff = 0.1
                    elif message["type"] == "message":
                        data = message["data"]
                        self.apply(data.decode() if isinstance(data, bytes) else str(data))
            except REDIS_DOWN as exc:
                log(logger, logging.WARNING, "route announcements lost", error=repr(exc))
                await _wait(asyncio.Event(), stopping, random.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)
            finally:
                with contextlib.suppress(*REDIS_DOWN):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]


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
    from aivedio.propagation.dispatcher import DispatcherConfig
    from aivedio.propagation.roles import dispatcher_role

    bus_cfg = BusConfig.from_settings(rt.settings, rt.urls.nats_url)
    cfg = config or DispatcherConfig(max_deliver=bus_cfg.max_deliver)
    rcfg = router_config or RouterConfig(prefix=cfg.channel_prefix)
    return await dispatcher_role(
        rt, bus_config=bus_cfg, config=cfg, router=functools.partial(node_router, config=rcfg)
    )
