"""Reliable propagation: the outbox relay (PostgreSQL -> bus) and the notification dispatcher
(bus -> Redis Pub/Sub). ``docs/explanation/propagation.md`` explains the guarantees."""

from aivedio.propagation.dead_letters import list_dead_letters, replay_dead_letter
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
)
from aivedio.propagation.relay import OutboxRelay, RelayConfig

__all__ = [
    "DispatcherConfig",
    "NotificationDispatcher",
    "OutboxRelay",
    "RelayConfig",
    "broadcast_channel",
    "list_dead_letters",
    "replay_dead_letter",
]
