"""Prometheus metrics of the notification gateway (seed §12.11.6)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
REDIS_RECONNECTS = Counter(
    "aivedio_gateway_redis_subscriptions_total", "Redis Pub/Sub (re)subscriptions"
)
