"""The bus port: publish with key + dedup id, durable consumer groups, ack / nak / dead letter.

This module imports no broker driver. Adapters (``jetstream.py``, ``memory.py``; a Kafka or
RocketMQ adapter would be one more module) implement :class:`Bus`, :class:`Consumer` and
:class:`Delivery`, raise only the errors below, and pass ``tests/contract/bus_contract.py``.

Semantics every adapter keeps:

* **At least once.** A message is delivered until it is acked, dead-lettered, or has been
  delivered ``max_deliver`` times. Consumers must be idempotent by business key.
* **Dedup on publish.** Two publishes with the same ``dedup_id`` inside ``duplicate_window_s``
  store one message; the second returns ``PublishAck(duplicate=True)``.
* **Groups.** Every group gets every message of the topic; the consumers of one group (in any
  number of processes) share the work, each message going to one of them at a time.
* **Order.** One consumer fetching from a group sees one key's messages in publish order until a
  message is redelivered (nak / ack timeout), which may overtake later ones.
* **Dead letter.** A message delivered ``max_deliver`` times and still not acked, or one the
  consumer ``term()``-inated, is stored as a :class:`DeadLetter` of its group; it can be listed
  and replayed to that group only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from aivedio.config import Settings
from aivedio.errors import AivedioError

__all__ = [
    "Bus",
    "BusClosed",
    "BusConfig",
    "BusError",
    "BusUnavailable",
    "Consumer",
    "DeadLetter",
    "Delivery",
    "OutgoingMessage",
    "PublishAck",
    "validate_group",
    "validate_topic",
]


class BusError(AivedioError):
    """Root of every bus error. Driver errors are translated into these at the adapter edge."""


class BusUnavailable(BusError):
    """The broker cannot be reached or did not answer in time. Retry later; nothing is lost by
    retrying because publishes are deduplicated by ``dedup_id``."""


class BusClosed(BusError):
    """The bus (or consumer) was closed by this process; it will not come back."""


@dataclass(frozen=True, slots=True)
class BusConfig:
    """What every adapter needs. Adapter-only knobs are ignored by adapters they do not fit."""

    url: str = "nats://127.0.0.1:4222"  # or redis:// for the Redis Streams adapter
    adapter: Literal["jetstream", "redis-streams"] = "jetstream"
    stream: str = "AIVEDIO"  # JetStream stream / Kafka cluster-level namespace
    subject_prefix: str = "aivedio"  # every topic lives under this prefix
    duplicate_window_s: float = 120.0  # publish dedup by dedup_id inside this window
    max_deliver: int = 5  # deliveries before a message is dead-lettered
    ack_wait_s: float = 30.0  # unacked delivery is redelivered after this
    max_in_flight: int = 256  # publish_many: messages awaiting a broker ack at once
    max_ack_pending: int = 1000  # per group: delivered but not yet acked, across its consumers
    publish_timeout_s: float = 5.0  # a publish without a broker ack by then -> BusUnavailable
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5  # pause between reconnect attempts (the client never gives up)
    request_timeout_s: float = 5.0  # management calls (create stream/consumer, list DLQ)
    retention_s: float = 3 * 24 * 3600.0  # how long published messages stay in the stream
    dead_letter_retention_s: float = 30 * 24 * 3600.0
    storage: Literal["file", "memory"] = "file"
    replicas: int = 1

    @classmethod
    def from_settings(
        cls, settings: Settings, nats_url: str, redis_url: str | None = None
    ) -> BusConfig:
        """The bus config from the process settings (the URLs as resolved): ``AIVEDIO_BUS``
        picks JetStream on ``nats_url`` or Redis Streams on ``redis_url``."""
        if settings.bus == "redis-streams":
            if not redis_url:
                raise ValueError("AIVEDIO_BUS=redis-streams needs a Redis URL")
            url = redis_url
        else:
            url = nats_url
        return cls(
            url=url,
            adapter=settings.bus,
            replicas=settings.bus_replicas,
            stream=settings.bus_stream,
            subject_prefix=settings.bus_subject_prefix,
            ack_wait_s=settings.bus_ack_wait_s,
        )


@dataclass(frozen=True, slots=True)
class PublishAck:
    """The broker stored the message (or had it already: ``duplicate``)."""

    stream: str
    sequence: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    topic: str
    key: str  # ordering / partition key, e.g. the task id
    dedup_id: str  # broker-side dedup, e.g. the outbox row id
    payload: bytes
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message its group gave up on."""

    id: str  # adapter-specific, opaque; pass to ``Bus.replay_dead_letter``
    group: str
    topic: str
    key: str
    dedup_id: str
    data: bytes
    headers: Mapping[str, str]
    deliveries: int
    reason: str  # "max_deliver" or the reason given to ``Delivery.term``
    dead_at: float  # unix seconds


class Delivery(Protocol):
    """One delivery of one message to one consumer. Settle it exactly once."""

    @property
    def topic(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def dedup_id(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def headers(self) -> Mapping[str, str]:
        """The publisher's headers only (adapter headers are stripped)."""
        ...

    @property
    def deliveries(self) -> int:
        """1 on the first delivery, 2 on the first redelivery, ..."""
        ...

    async def ack(self) -> None:
        """Done: never deliver this message to this group again."""

    async def nak(self, delay_s: float = 0.0) -> None:
        """Not done: deliver it again (to any consumer of the group) after ``delay_s``."""

    async def in_progress(self) -> None:
        """Still working: restart the ack wait so the message is not redelivered meanwhile."""

    async def term(self, reason: str = "terminated") -> None:
        """Give up now: store the message as a dead letter of this group; no more deliveries."""


class Consumer(Protocol):
    """A member of a durable consumer group on one topic."""

    @property
    def topic(self) -> str: ...
    @property
    def group(self) -> str: ...

    # ``timeout`` is the broker-side long-poll expiry of the pull, not a client cancel scope.
    async def fetch(self, batch: int = 100, timeout: float = 1.0) -> list[Delivery]:  # noqa: ASYNC109
        """Up to ``batch`` deliveries; waits up to ``timeout`` for the first one, returns ``[]``
        if none came. Raises ``BusUnavailable`` when the broker is unreachable."""
        ...

    async def close(self) -> None:
        """Stop fetching. The group (and its position) stays for the next consumer."""


@runtime_checkable
class Bus(Protocol):
    """The message bus. Create with ``await aivedio.bus.connect.connect(cfg)`` (or an adapter's own
    ``connect``)."""

    async def publish(
        self,
        topic: str,
        key: str,
        dedup_id: str,
        payload: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> PublishAck:
        """Store one message; returns after the broker's ack."""
        ...

    async def publish_many(
        self, messages: Sequence[OutgoingMessage]
    ) -> list[PublishAck | BusError | ValueError]:
        """Publish with up to ``max_in_flight`` messages awaiting acks; one result per message,
        in input order (an error in one slot does not stop the others). Messages go out in input
        order, so one key's messages are stored in order unless one of them failed."""
        ...

    async def subscribe(
        self, topic: str, group: str, *, start: Literal["all", "new"] = "all"
    ) -> Consumer:
        """Join (creating if needed) the durable ``group`` on ``topic``. ``start`` applies only
        when the group is created: from the oldest retained message, or only new ones."""
        ...

    async def dead_letters(self, group: str, limit: int = 100) -> list[DeadLetter]:
        """The oldest ``limit`` dead letters of ``group`` (all topics)."""
        ...

    async def replay_dead_letter(self, group: str, dead_letter_id: str) -> PublishAck:
        """Deliver the dead letter again to ``group`` only (as a new message, deliveries from 1)
        and remove it from the dead letters. Raises ``BusError`` if it does not exist."""
        ...

    async def close(self) -> None:
        """Close the connection; idempotent. Later calls raise ``BusClosed``."""
        ...


_TOPIC = re.compile(r"^[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*$")
_GROUP = re.compile(r"^[A-Za-z0-9-]+$")


def validate_topic(topic: str) -> str:
    """Topics are dot-separated tokens of letters, digits and ``-`` (``task.status``)."""
    if not _TOPIC.fullmatch(topic) or len(topic) > 200:
        raise ValueError(f"invalid bus topic {topic!r}: dot-separated [A-Za-z0-9-] tokens")
    return topic


def validate_group(group: str) -> str:
    """Groups are one token of letters, digits and ``-`` (``dispatcher``, ``media-worker``)."""
    if not _GROUP.fullmatch(group) or len(group) > 100:
        raise ValueError(f"invalid bus group {group!r}: one [A-Za-z0-9-] token")
    return group


RESERVED_HEADER_PREFIXES = ("nats-", "aivedio-")


def validate_message(key: str, dedup_id: str, headers: Mapping[str, str] | None) -> None:
    """Keys and dedup ids are non-empty single-line strings; header names starting with
    ``Nats-`` or ``Aivedio-`` belong to the adapters."""
    for name, value in (("key", key), ("dedup_id", dedup_id)):
        if not value or "\r" in value or "\n" in value or len(value) > 512:
            raise ValueError(f"bus message {name} must be a non-empty single-line string")
    for header in headers or {}:
        if header.lower().startswith(RESERVED_HEADER_PREFIXES):
            raise ValueError(f"bus header {header!r} is reserved for the adapter")
