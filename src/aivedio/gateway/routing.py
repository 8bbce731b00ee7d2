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

The dispatcher's side, which reads these routes, is :mod:`aivedio.propagation.routing`.

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
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Literal

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from aivedio.channels import INTEREST_PREFIX, routes_changed_channel, routes_key
from aivedio.logs import log
from aivedio.polling.ratelimit import mark_interests

__all__ = [
    "InterestMarks",
    "NodeRoutes",
    "new_node_id",
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
