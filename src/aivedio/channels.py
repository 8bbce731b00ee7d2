"""Every Redis channel and key name aivedio uses, in one place (standard library only).

The dispatcher publishes to these channels and the gateways subscribe to them; the poller and
the gateways share the interest keys. A name defined here once cannot drift apart between the
publishing and the subscribing side.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_PREFIX",
    "GATEWAY_KEY_PREFIX",
    "INTEREST_PREFIX",
    "RATE_LIMIT_PREFIX",
    "broadcast_channel",
    "node_channel",
    "routes_changed_channel",
    "routes_key",
]

DEFAULT_PREFIX = "aivedio"
INTEREST_PREFIX = f"{DEFAULT_PREFIX}:interest"  # keys of tasks/projects someone is watching
GATEWAY_KEY_PREFIX = f"{DEFAULT_PREFIX}:gw"  # keys of the gateway's connection counters
RATE_LIMIT_PREFIX = f"{DEFAULT_PREFIX}:rl"  # keys of the poller's rate-limit buckets


def broadcast_channel(prefix: str = DEFAULT_PREFIX) -> str:
    """The channel every gateway subscribes to in broadcast fan-out (``<prefix>:events``)."""
    return f"{prefix}:events"


def node_channel(prefix: str, node_id: str) -> str:
    """The Pub/Sub channel of one gateway node (node fan-out)."""
    return f"{prefix}:node:{node_id}"


def routes_key(prefix: str) -> str:
    """The sorted set of ``<project_id>:<node_id>`` members scored by expiry (unix ms)."""
    return f"{prefix}:routes"


def routes_changed_channel(prefix: str) -> str:
    """Route additions (``+member expiry``) and removals (``-member``), for the dispatchers."""
    return f"{prefix}:routes:changed"
