"""The notification dispatcher: bus ``task.status`` -> the fan-out (Redis Pub/Sub), for the
gateways.

Consumes two topics as the durable group ``dispatcher`` (any number of replicas share it):
``task.status`` (every version that changes more than the progress, which the internal consumers
read too) and ``task.progress`` (the progress-only versions, for browsers alone: the relay routes
them there so that media and billing never fetch, parse and ack them; ``state.events``). One loop
per topic, each with its own consumer and version filter: a task's events of one topic reach the
fan-out in the order they were stored; across the two topics they may swap by a few
milliseconds, which the gateway's per-project ordering absorbs (it holds a seq that came early
for ``reorder_wait_s``, as it does for events of two dispatcher replicas). For each
fetched batch: parse every delivery, drop the ones whose ``(task_id, task_version)`` is not newer
than the highest version this loop already published for that task (a bounded LRU), publish the
rest as one fan-out batch (:class:`~aivedio.fanout.FanoutPublisher`; on Redis one call, a Lua
script looping over PUBLISH: one reply per batch, see :mod:`aivedio.fanout.redis`), and ack the
whole batch only after the fan-out answered. If it is unreachable, the batch is nak-ed with a
delay and fetching pauses until it answers a ping: the events are still on the bus, and in
PostgreSQL for any browser that reconnects.

What reaches Redis (one JSON object per event; :func:`routed_message`)::

    {"type": "task.status", "project_id": ..., "epoch": 7, "seq": 42, "task_id": ...,
     "task_version": 5, "public": {"event_id": 42, "task_id": ..., "task_version": 5,
                                    "status": ..., "stage": ..., "progress": ..., ...},
     "stored_at": 1767225600.120001, "relayed_at": 1767225600.123456,
     "dispatched_at": 1767225600.124789, "trace_id": "trc_..."}

``stored_at`` (the outbox insert, DB clock) and ``relayed_at`` (the relay's publish), which the
relay appends to the bus event (``null`` without them), and ``dispatched_at`` (this batch's
PUBLISH) are Unix times for measuring where the time goes (``aivedio_dispatch_lag_seconds``,
the gateway's ``aivedio_gateway_event_age_seconds``, ``aivedio bench e2e``); ``trace_id`` is the
trace id that entered with the callback or API request, for the gateway's log line. The gateway
never forwards any of them to a browser.

Duplicates can still reach Redis (two replicas, or an LRU eviction, or a restart); the gateway and
the browser drop them by seq / version, so they are harmless. Redis Pub/Sub itself is at most
once; the gateway repairs gaps from PostgreSQL (DESIGN.md decision 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter, Histogram

from aivedio.bus import Bus, BusClosed, BusError, BusUnavailable, Consumer, Delivery
from aivedio.channels import DEFAULT_PREFIX, broadcast_channel
from aivedio.fanout import FanoutError, FanoutPublisher
from aivedio.logs import log
from aivedio.process import health

__all__ = [
    "DispatcherConfig",
    "NotificationDispatcher",
    "RoutedEvent",
    "VersionFilter",
    "broadcast_channel",
    "parse_event",
    "routed_message",
]

logger = logging.getLogger("aivedio.dispatcher")

EVENTS = Counter(
    "aivedio_dispatch_events_total",
    "Bus events seen by the dispatcher, by outcome "
    "(published, duplicate, ignored, malformed, retried)",
    ["outcome"],
)
REDIS_ERRORS = Counter(
    "aivedio_dispatch_redis_errors_total",
    "Fan-out (Redis) batch publishes that failed (batch nak-ed)",
)
LAG_SECONDS = Histogram(
    "aivedio_dispatch_lag_seconds",
    "Per published event: the relay's publish to the bus -> this dispatcher's Redis PUBLISH",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
)
BATCH_SECONDS = Histogram(
    "aivedio_dispatch_batch_seconds",
    "From a fetched batch to its acks: parse, Redis pipeline, ack",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    topics: tuple[str, ...] = ("task.status", "task.progress")
    group: str = "dispatcher"
    channel_prefix: str = DEFAULT_PREFIX
    batch_size: int = 500
    idle_fetch_s: float = 1.0  # long-poll for the next event when there is nothing to do
    lru_size: int = 100_000  # tasks whose highest published version is remembered
    max_deliver: int = 5  # the bus's; a malformed event is dead-lettered on its last delivery
    malformed_delay_s: float = 1.0  # nak delay of an event this replica cannot read
    redis_nak_delay_s: float = 0.5  # nak delay of a batch the fan-out did not take
    redis_timeout_s: float = 2.0  # the fan-out client's socket timeouts (RedisFanout.from_url)
    redis_probe_s: float = 0.5  # ping interval while the fan-out is unreachable


@dataclass(frozen=True, slots=True)
class RoutedEvent:
    """The routing fields the gateway needs, plus the public payload."""

    project_id: str
    epoch: int
    seq: int
    task_id: str
    task_version: int
    public: dict[str, Any]
    relayed_at: float | None = None  # when the relay published it (appended to the bus event)
    stored_at: float | None = None  # the outbox insert (appended by the relay)
    trace_id: str | None = None


class Malformed(ValueError):
    """A bus event this dispatcher cannot read."""


def parse_event(data: bytes) -> RoutedEvent | None:
    """The routed event of a ``task.status.changed`` outbox payload; ``None`` for another event
    type or a version that is not a public event (``public`` null); raises :class:`Malformed`
    for anything unreadable."""
    try:
        body = orjson.loads(data)  # the bytes as they came from the bus; invalid UTF-8 included
    except orjson.JSONDecodeError as exc:
        raise Malformed(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Malformed("not a JSON object")
    if body.get("event_type") != "task.status.changed":
        return None
    try:
        public = body["public"]
        if public is None:  # a task version that is not a public event (no seq): nothing to send
            return None
        if not isinstance(public, dict):
            raise Malformed("public is not an object")
        seq = _int(body["event_id"])
        public["event_id"] = seq  # a dict of its own, parsed just now: no copy
        return RoutedEvent(
            project_id=str(body["project_id"]),
            epoch=_int(body["epoch"]),
            seq=seq,
            task_id=str(body["aggregate_id"]),
            task_version=_int(body["aggregate_version"]),
            public=public,
            relayed_at=_time(body.get("relayed_at")),
            stored_at=_time(body.get("stored_at")),
            trace_id=_text(body.get("trace_id")),
        )
    except KeyError as exc:
        raise Malformed(f"missing field {exc}") from None


def _time(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"expected an integer, got {value!r}")
    return value


def routed_message(event: RoutedEvent, dispatched_at: float | None = None) -> bytes:
    """The Redis message of one event (orjson: compact, UTF-8, ~20x the stdlib encoder)."""
    return orjson.dumps(
        {
            "type": "task.status",
            "project_id": event.project_id,
            "epoch": event.epoch,
            "seq": event.seq,
            "task_id": event.task_id,
            "task_version": event.task_version,
            "public": event.public,
            "stored_at": event.stored_at,
            "relayed_at": event.relayed_at,
            "dispatched_at": dispatched_at,
            "trace_id": event.trace_id,
        }
    )


class VersionFilter:
    """The highest version published per task, for the last ``size`` tasks seen (an LRU)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: OrderedDict[str, int] = OrderedDict()

    def is_new(self, task_id: str, version: int) -> bool:
        last = self._seen.get(task_id)
        return last is None or version > last

    def record(self, task_id: str, version: int) -> None:
        last = self._seen.get(task_id)
        if last is None or version > last:
            self._seen[task_id] = version
        self._seen.move_to_end(task_id)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


Router = Callable[[RoutedEvent], Sequence[str]]


class NotificationDispatcher:
    """One dispatcher replica. ``run(stopping)`` consumes until ``stopping`` is set."""

    def __init__(
        self,
        bus: Bus,
        fanout: FanoutPublisher,
        config: DispatcherConfig | None = None,
        *,
        router: Router | None = None,
    ) -> None:
        self.bus = bus
        self.fanout = fanout
        self.config = config or DispatcherConfig()
        channel = broadcast_channel(self.config.channel_prefix)
        self.router: Router = router or (lambda _event: (channel,))
        self._failure: FanoutError | None = None  # the last failed publish, for health

    async def run(self, stopping: asyncio.Event) -> None:
        """One loop per topic (:meth:`consume`) until ``stopping`` is set; the first one that
        fails stops the others."""
        loops = [asyncio.create_task(self.consume(t, stopping)) for t in self.config.topics]
        try:
            await asyncio.gather(*loops)
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def consume(self, topic: str, stopping: asyncio.Event) -> None:
        """Fetch, publish, ack, in order, on one topic. The next batch is fetched while this one
        is published (one pull request ahead), so events arriving meanwhile do not wait for a
        round trip to the broker after the acks. One consumer, batches handled one after the
        other: one task's events of this topic reach the fan-out in the order they were
        stored."""
        cfg = self.config
        versions = VersionFilter(cfg.lru_size)
        consumer: Consumer | None = None
        failures = 0
        ahead: asyncio.Task[list[Delivery]] | None = None
        try:
            while not stopping.is_set():
                try:
                    if consumer is None:
                        consumer = await self.bus.subscribe(topic, cfg.group)
                    if ahead is not None:
                        fetching, ahead = ahead, None
                        deliveries = await fetching
                    else:
                        deliveries = await self._next_batch(consumer)
                    failures = 0
                except BusClosed:
                    return
                except BusUnavailable as exc:
                    failures += 1
                    log(logger, logging.WARNING, "dispatcher cannot fetch", error=str(exc))
                    health.outage("bus", exc)
                    await _pause(stopping, min(2.0, 0.1 * 2**failures))
                    continue
                if not deliveries:
                    health.recovered()
                    continue
                ahead = asyncio.create_task(self._next_batch(consumer))
                if await self.handle(deliveries, versions):
                    health.recovered()
                else:
                    # The fan-out is away: what was fetched meanwhile goes back to the bus too.
                    health.outage(self.fanout.service, self._failure or "FanoutUnavailable")
                    fetching, ahead = ahead, None
                    with contextlib.suppress(BusError):
                        await self._settle(await fetching, nak_delay=cfg.redis_nak_delay_s)
                    await self._wait_for_fanout(stopping)
        finally:
            if ahead is not None:  # stopping: its deliveries come back after the ack wait
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)
            if consumer is not None:
                await consumer.close()

    async def _next_batch(self, consumer: Consumer) -> list[Delivery]:
        """What is there now (up to a batch), else the first events to arrive within
        ``idle_fetch_s``: the bus returns as soon as it has any (one request, no linger)."""
        return await consumer.fetch(self.config.batch_size, timeout=self.config.idle_fetch_s)

    async def handle(self, deliveries: Sequence[Delivery], versions: VersionFilter) -> bool:
        """Publish one batch to the fan-out and settle every delivery; ``False`` if it failed.
        ``versions``: the highest version published per task, of the batch's topic."""
        started = time.perf_counter()
        publish, drop = await self._sort(deliveries, versions)
        if publish and not await self._publish(publish, versions):
            await self._settle([d for d, _ in publish], nak_delay=self.config.redis_nak_delay_s)
            await self._settle(drop)
            return False
        await self._settle([d for d, _ in publish] + drop)
        BATCH_SECONDS.observe(time.perf_counter() - started)
        return True

    async def _sort(
        self, deliveries: Sequence[Delivery], versions: VersionFilter
    ) -> tuple[list[tuple[Delivery, RoutedEvent]], list[Delivery]]:
        """Split a batch into the new events to publish and the deliveries to ack unpublished
        (ignored types, duplicates); a malformed delivery is handled on the spot."""
        publish: list[tuple[Delivery, RoutedEvent]] = []
        drop: list[Delivery] = []
        batch_high: dict[str, int] = {}
        for d in deliveries:
            try:
                event = parse_event(d.data)
            except Malformed as exc:
                await self._malformed(d, str(exc))
                continue
            if event is None:
                EVENTS.labels("ignored").inc()
                drop.append(d)
                continue
            high = batch_high.get(event.task_id)
            if (high is not None and event.task_version <= high) or not versions.is_new(
                event.task_id, event.task_version
            ):
                EVENTS.labels("duplicate").inc()
                drop.append(d)
                continue
            batch_high[event.task_id] = event.task_version
            publish.append((d, event))
        return publish, drop

    async def _publish(
        self, publish: list[tuple[Delivery, RoutedEvent]], versions: VersionFilter
    ) -> bool:
        """One fan-out round trip for the batch's events; ``False`` (logged) if it failed."""
        try:
            messages: list[tuple[str, bytes]] = []
            dispatched = time.time()
            for _, event in publish:
                body = routed_message(event, dispatched)
                for channel in self.router(event):
                    messages.append((channel, body))
            if messages:
                await self.fanout.publish_many(messages)
        except FanoutError as exc:
            self._failure = exc
            REDIS_ERRORS.inc()
            EVENTS.labels("retried").inc(len(publish))
            log(
                logger,
                logging.WARNING,
                "fan-out publish failed",
                error=repr(exc),
                trace_ids=sorted({e.trace_id for _, e in publish if e.trace_id}),
            )
            return False
        for _, event in publish:
            versions.record(event.task_id, event.task_version)
            if event.relayed_at is not None:
                LAG_SECONDS.observe(max(0.0, dispatched - event.relayed_at))
        EVENTS.labels("published").inc(len(publish))
        if logger.isEnabledFor(logging.DEBUG):
            log(
                logger,
                logging.DEBUG,
                "events published to redis",  # the documented log line (metrics.md)
                events=[
                    {"task_id": e.task_id, "seq": e.seq, "trace_id": e.trace_id} for _, e in publish
                ],
            )
        return True

    async def _malformed(self, d: Delivery, reason: str) -> None:
        """Another replica (a newer version during a deploy) may read it: nak it, and give up
        with the reason on its last delivery, so the dead letter says why."""
        EVENTS.labels("malformed").inc()
        log(logger, logging.WARNING, "malformed bus event", key=d.key, reason=reason)
        try:
            if d.deliveries >= self.config.max_deliver:
                await d.term(f"malformed: {reason}")
            else:
                await d.nak(self.config.malformed_delay_s)
        except BusError as exc:  # it comes back after ack_wait
            log(logger, logging.WARNING, "settling a malformed event failed", error=str(exc))

    @staticmethod
    async def _settle(deliveries: Sequence[Delivery], nak_delay: float | None = None) -> None:
        for d in deliveries:
            try:
                if nak_delay is None:
                    await d.ack()
                else:
                    await d.nak(nak_delay)
            except BusError as exc:  # redelivered after ack_wait; the version filter drops it
                log(logger, logging.WARNING, "settling a delivery failed", error=str(exc))
                return

    async def _wait_for_fanout(self, stopping: asyncio.Event) -> None:
        """Fetch nothing more until the fan-out answers: every fetch would only burn a
        delivery."""
        while not stopping.is_set():
            await _pause(stopping, self.config.redis_probe_s)
            try:
                await self.fanout.ping()
            except FanoutError:
                continue
            log(logger, logging.INFO, "fan-out reachable again", service=self.fanout.service)
            self._failure = None
            return


async def _pause(stopping: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
