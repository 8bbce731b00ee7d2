"""The fan-out port: at-most-once broadcast of small messages to whoever listens on a channel.

The dispatcher publishes each batch of events to one or more channels (``aivedio:events``, or
one channel per gateway node); every gateway node keeps one subscription. This module imports no
driver. Adapters (``redis.py`` on Redis Pub/Sub, ``memory.py`` in-process for unit tests)
implement :class:`FanoutPublisher`, :class:`FanoutSubscriber` and :class:`Subscription`, raise
only the errors below, and pass ``tests/contract/fanout_contract.py``. Channel names come from
:mod:`aivedio.channels`.

Semantics every adapter keeps:

* **At most once.** A message reaches the subscriptions to its channel that exist when it is
  published, or none of them: nothing is stored, nothing is redelivered. Callers repair gaps
  from their own store (the gateway from PostgreSQL, DESIGN.md decision 4).
* **Channels are separate.** A subscription receives the messages of its channels only.
* **Order.** One publisher's messages to one channel arrive at each subscription in publish
  order (a batch in input order).
* **(Re)established.** :class:`Subscribed` is delivered when a subscription to a channel is in
  place: first after ``subscribe``, and again whenever the adapter re-established it after the
  connection dropped. Whatever was published in between may be lost, so a caller that needs
  every message checks its store after each :class:`Subscribed`.
* **Outages.** A connection the adapter cannot (re-)establish is :class:`FanoutUnavailable`:
  from ``publish_many`` (nothing, or only a part, of the batch went out), ``ping``, or
  ``Subscription.next`` (the subscription is dead: close it and open a new one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aivedio.errors import AivedioError

__all__ = [
    "FanoutError",
    "FanoutPublisher",
    "FanoutSubscriber",
    "FanoutUnavailable",
    "Message",
    "Subscribed",
    "Subscription",
]


class FanoutError(AivedioError):
    """Root of every fan-out error. Driver errors are translated into these at the adapter
    edge."""


class FanoutUnavailable(FanoutError):
    """The fan-out server cannot be reached, dropped the connection, or did not answer in
    time. Retry later (a publish may have reached some subscribers already: at most once)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One published message, as a subscription receives it."""

    channel: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Subscribed:
    """The subscription to ``channel`` is (again) in place; messages published to it before
    this may have been missed."""

    channel: str


@runtime_checkable
class FanoutPublisher(Protocol):
    """The publishing side (the dispatcher)."""

    @property
    def service(self) -> str:
        """What is away when this raises :class:`FanoutUnavailable` (``"redis"``): the
        dependency named in outage reports (``/readyz``)."""
        ...

    async def publish_many(self, messages: Sequence[tuple[str, bytes]]) -> int:
        """Publish ``(channel, data)`` pairs in order, as one batch (one round trip where the
        adapter can); returns how many were published. Raises :class:`FanoutUnavailable`."""
        ...

    async def ping(self) -> None:
        """Return when the server answers; raises :class:`FanoutUnavailable` otherwise."""
        ...

    async def close(self) -> None:
        """Release the connection (idempotent)."""
        ...


class Subscription(Protocol):
    """One subscriber connection and the channels it listens to."""

    async def subscribe(self, *channels: str) -> None:
        """Listen to ``channels`` too; a :class:`Subscribed` per channel follows in
        :meth:`next`. Raises :class:`FanoutUnavailable`."""
        ...

    async def unsubscribe(self, *channels: str) -> None:
        """Stop listening to ``channels`` (messages already on their way may still arrive)."""
        ...

    # ``timeout`` bounds the wait for the next message, not a cancel scope around it.
    async def next(self, timeout: float = 1.0) -> Message | Subscribed | None:  # noqa: ASYNC109
        """The next message or :class:`Subscribed`, waiting up to ``timeout`` seconds for one
        (``0``: only what has arrived already); ``None`` if nothing came. Raises
        :class:`FanoutUnavailable` when the connection is lost for good."""
        ...

    async def close(self) -> None:
        """Unsubscribe from everything and release the connection (idempotent)."""
        ...


@runtime_checkable
class FanoutSubscriber(Protocol):
    """The subscribing side (a gateway node): makes subscriptions."""

    @property
    def service(self) -> str:
        """The dependency named in outage reports, as :attr:`FanoutPublisher.service`."""
        ...

    def subscription(self) -> Subscription:
        """A new subscription with no channels yet (it connects on its first ``subscribe``)."""
        ...
