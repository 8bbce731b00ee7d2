"""An in-process fan-out for unit tests. It passes the same contract suite as the Redis adapter.

One :class:`MemoryFanout` plays the server and both client sides: a publish appends the message
to the queue of every subscription to its channel at that moment (synchronously, so one
publisher's messages keep their order). :meth:`MemoryFanout.drop_connections` plays the server
dropping every subscriber connection (each comes back at once and says :class:`Subscribed`
again, as redis-py does); :meth:`MemoryFanout.set_available` plays a server that is away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aivedio.fanout.port import FanoutUnavailable, Message, Subscribed

if TYPE_CHECKING:
    from aivedio.fanout.port import FanoutPublisher, FanoutSubscriber, Subscription

__all__ = ["MemoryFanout", "MemorySubscription"]


class MemoryFanout:
    """The server and both sides of the port, in this process."""

    service = "memory"

    def __init__(self) -> None:
        self.available = True
        self._subscriptions: set[MemorySubscription] = set()

    def set_available(self, available: bool) -> None:
        """``False``: every call raises :class:`FanoutUnavailable` (and live subscriptions die
        with it, as their connections would), until set ``True`` again."""
        self.available = available
        if not available:
            for sub in list(self._subscriptions):
                sub._lost()

    def drop_connections(self) -> None:
        """The server drops every subscriber connection; each one reconnects and re-subscribes
        at once (a :class:`Subscribed` per channel)."""
        for sub in list(self._subscriptions):
            sub._reconnected()

    def _check(self) -> None:
        if not self.available:
            raise FanoutUnavailable("memory fan-out is unavailable")

    async def publish_many(self, messages: Sequence[tuple[str, bytes]]) -> int:
        self._check()
        for channel, data in messages:
            message = Message(channel, bytes(data))
            for sub in self._subscriptions:
                if channel in sub.channels:
                    sub._queue.put_nowait(message)
        return len(messages)

    async def ping(self) -> None:
        self._check()

    def subscription(self) -> MemorySubscription:
        return MemorySubscription(self)

    async def close(self) -> None:
        return None


class MemorySubscription:
    """One subscriber "connection" of a :class:`MemoryFanout`."""

    def __init__(self, fanout: MemoryFanout) -> None:
        self.fanout = fanout
        self.channels: set[str] = set()
        self._queue: asyncio.Queue[Message | Subscribed | FanoutUnavailable] = asyncio.Queue()
        self._dead = False

    def _lost(self) -> None:
        self._dead = True
        self.fanout._subscriptions.discard(self)
        self._queue.put_nowait(FanoutUnavailable("memory fan-out connection lost"))

    def _reconnected(self) -> None:
        for channel in sorted(self.channels):
            self._queue.put_nowait(Subscribed(channel))

    def _check(self) -> None:
        self.fanout._check()
        if self._dead:
            raise FanoutUnavailable("memory fan-out subscription is closed")

    async def subscribe(self, *channels: str) -> None:
        self._check()
        self.fanout._subscriptions.add(self)
        for channel in channels:
            self.channels.add(channel)
            self._queue.put_nowait(Subscribed(channel))

    async def unsubscribe(self, *channels: str) -> None:
        self._check()
        self.channels.difference_update(channels)

    async def next(self, timeout: float = 1.0) -> Message | Subscribed | None:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._queue.empty():
                self._check()
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    item = self._queue.get_nowait()
                else:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
            except (asyncio.QueueEmpty, TimeoutError):
                return None
            if isinstance(item, FanoutUnavailable):
                raise item
            if isinstance(item, Message) and item.channel not in self.channels:
                continue  # unsubscribed meanwhile: as if never sent
            return item

    async def close(self) -> None:
        self._dead = True
        self.channels.clear()
        self.fanout._subscriptions.discard(self)
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self._queue.get_nowait()


if TYPE_CHECKING:  # static proof that the fake implements the port

    def _conforms(
        f: MemoryFanout, s: MemorySubscription
    ) -> tuple[FanoutPublisher, FanoutSubscriber, Subscription]:
        return f, f, s
