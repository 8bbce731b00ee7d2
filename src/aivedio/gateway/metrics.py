"""Prometheus metrics of the notification gateway (seed §12.11.6)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

CONNECTIONS = Gauge("aivedio_gateway_connections", "Open event-stream connections", ["transport"])
OPENED = Counter("aivedio_gateway_connections_opened_total", "Streams opened", ["transport"])
CLOSED = Counter(
    "aivedio_gateway_connections_closed_total", "Streams closed, by close reason", ["reason"]
)
REFUSED = Counter(
    "aivedio_gateway_connections_refused_total", "Stream requests refused", ["reason"]
)
FRAMES = Counter("aivedio_gateway_frames_written_total", "Event frames written to connections")
EVENTS = Counter("aivedio_gateway_events_total", "Events delivered by project streams", ["source"])
SLOW = Counter("aivedio_gateway_slow_evictions_total", "Connections closed as slow")
RESETS = Counter("aivedio_gateway_resets_total", "event: reset frames sent", ["reason"])
GAP_REPAIRS = Counter("aivedio_gateway_gap_repairs_total", "Live seq gaps filled from PostgreSQL")
TAIL_REPAIRS = Counter(
    "aivedio_gateway_tailcheck_repairs_total", "Streams found behind their head by the tail check"
)
# Once per event and node, when its frame is handed to the node's connections: from its outbox
# row's insert (DB clock, the transaction that committed it) to now; ``source`` live or repair.
EVENT_AGE = Histogram(
    "aivedio_gateway_event_age_seconds",
    "End-to-end event age at the socket: outbox insert -> frame written to the connections",
    ["source"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
# Children looked up once (``labels()`` takes a lock and hashes per call): once per event.
EVENT_AGE_BY_SOURCE = {source: EVENT_AGE.labels(source) for source in ("live", "repair")}
REDIS_RECONNECTS = Counter(
    "aivedio_gateway_redis_subscriptions_total", "Redis Pub/Sub (re)subscriptions"
)


class _SessionSource(Protocol):
    def sessions(self) -> Iterable[Any]: ...


# The hubs of this process's gateways; the send-queue gauges read their sessions when scraped
# (nothing is counted per event).
_HUBS: weakref.WeakSet[Any] = weakref.WeakSet()


def watch(hub: _SessionSource) -> None:
    _HUBS.add(hub)


def _queue_lengths() -> list[int]:
    return [
        len(session.pending)
        for hub in list(_HUBS)
        for session in hub.sessions()
        if session.pending is not None
    ]


QUEUED = Gauge(
    "aivedio_gateway_queued_events",
    "Events waiting in the send queues of connections whose socket is not writable (at scrape)",
)
QUEUED.set_function(lambda: float(sum(_queue_lengths())))
LONGEST_QUEUE = Gauge(
    "aivedio_gateway_longest_queue_events",
    "The longest send queue of one connection, in events (at scrape)",
)
LONGEST_QUEUE.set_function(lambda: float(max(_queue_lengths(), default=0)))
