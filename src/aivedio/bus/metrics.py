"""Prometheus metrics every bus adapter exports (the same names whichever broker is behind)."""

from __future__ import annotations

from prometheus_client import Counter

REDELIVERIES = Counter(
    "aivedio_bus_redeliveries_total",
    "Deliveries handed to a consumer group again (not acked in time, or nak-ed)",
    ["topic", "group"],
)
DEAD_LETTERS = Counter(
    "aivedio_bus_dead_letters_total",
    "Messages moved to the dead-letter stream, by topic, group and reason "
    "(max_deliver, or the consumer's own term reason class)",
    ["topic", "group", "reason"],
)


def reason_class(reason: str) -> str:
    """A bounded label for a dead letter's reason: ``max_deliver``, else the text before the
    first colon (``malformed: not JSON`` -> ``malformed``), at most 32 characters."""
    return reason.split(":", 1)[0].strip()[:32] or "terminated"
