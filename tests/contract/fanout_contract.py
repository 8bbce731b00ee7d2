"""The fan-out contract: one set of tests every fan-out adapter (and the in-memory fake) passes.

Subclass :class:`FanoutContract` as ``Test<Adapter>Fanout`` and provide the fixtures
``publisher`` and ``subscriber`` (connected to the same server; cleaned up after the test),
``drop`` (an async callable: the server drops every subscriber connection ``subscriber`` made)
and ``dead_publisher`` (a publisher whose server cannot be reached). Every test uses channels
under its own ``prefix``. Every wait is bounded; nothing asserts how long something took.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from aivedio.fanout import (
    FanoutPublisher,
    FanoutSubscriber,
    FanoutUnavailable,
    Message,
    Subscribed,
    Subscription,
)
from tests.waiting import eventually

Drop = Callable[[], Awaitable[None]]

WITHIN_S = 10.0


async def receive(sub: Subscription, n: int, *, within_s: float = WITHIN_S) -> list[Message]:
    """The next ``n`` messages (skipping :class:`Subscribed`), which must come within
    ``within_s``."""
    got: list[Message] = []

    async def enough() -> bool:
        event = await sub.next(timeout=0.2)
        if isinstance(event, Message):
            got.append(event)
        return len(got) >= n

    await eventually(enough, f"{n} messages", within_s)
    return got


async def receive_until(sub: Subscription, marker: Message) -> list[Message]:
    """Every message up to and including ``marker`` (which must come within ``WITHIN_S``)."""
    got: list[Message] = []

    async def arrived() -> bool:
        event = await sub.next(timeout=0.2)
        if isinstance(event, Message):
            got.append(event)
        return marker in got

    await eventually(arrived, f"{marker}", WITHIN_S)
    return got


async def subscribed(sub: Subscription, *channels: str) -> None:
    """Wait for the :class:`Subscribed` of each of ``channels`` (no message may come first)."""
    waiting = set(channels)

    async def all_subscribed() -> bool:
        event = await sub.next(timeout=0.2)
        assert not isinstance(event, Message), f"a message before Subscribed: {event}"
        if isinstance(event, Subscribed):
            waiting.discard(event.channel)
        return not waiting

    await eventually(all_subscribed, f"Subscribed to {sorted(channels)}", WITHIN_S)


class FanoutContract:
    """Shared tests. Subclasses provide ``publisher``, ``subscriber``, ``drop`` and
    ``dead_publisher``."""

    @pytest.fixture
    def publisher(self) -> FanoutPublisher:
        raise NotImplementedError

    @pytest.fixture
    def subscriber(self) -> FanoutSubscriber:
        raise NotImplementedError

    @pytest.fixture
    def drop(self) -> Drop:
        raise NotImplementedError

    @pytest.fixture
    def dead_publisher(self) -> FanoutPublisher:
        raise NotImplementedError

    @pytest.fixture
    def prefix(self) -> str:
        return f"contract-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    async def open_subscription(
        self, subscriber: FanoutSubscriber
    ) -> AsyncIterator[Callable[..., Awaitable[Subscription]]]:
        """``await open_subscription(*channels)``: subscribed (its ``Subscribed`` seen) and
        closed after the test."""
        made: list[Subscription] = []

        async def open_(*channels: str) -> Subscription:
            sub = subscriber.subscription()
            made.append(sub)
            await sub.subscribe(*channels)
            await subscribed(sub, *channels)
            return sub

        yield open_
        for sub in made:
            await sub.close()

    # -- the port ------------------------------------------------------------------------

    def test_implements_the_port(
        self, publisher: FanoutPublisher, subscriber: FanoutSubscriber
    ) -> None:
        assert isinstance(publisher, FanoutPublisher)
        assert isinstance(subscriber, FanoutSubscriber)
        assert publisher.service and subscriber.service

    async def test_ping(self, publisher: FanoutPublisher) -> None:
        await publisher.ping()

    async def test_next_returns_none_when_nothing_comes(
        self, open_subscription: Callable[..., Awaitable[Subscription]], prefix: str
    ) -> None:
        sub = await open_subscription(f"{prefix}:a")
        assert await sub.next(timeout=0) is None
        assert await sub.next(timeout=0.2) is None

    # -- delivery ------------------------------------------------------------------------

    async def test_message_reaches_its_channel_only(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a, b = f"{prefix}:a", f"{prefix}:b"
        sub_a = await open_subscription(a)
        sub_b = await open_subscription(b)
        assert await publisher.publish_many([(a, b"for a")]) == 1
        assert await receive(sub_a, 1) == [Message(a, b"for a")]
        await publisher.publish_many([(b, b"for b")])
        # sub_b sees b's message only: a's was never its.
        assert await receive_until(sub_b, Message(b, b"for b")) == [Message(b, b"for b")]

    async def test_batch_in_order_per_channel(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a, b = f"{prefix}:a", f"{prefix}:b"
        sub = await open_subscription(a, b)
        batch = [(a if i % 3 else b, f"m{i}".encode()) for i in range(60)]
        assert await publisher.publish_many(batch) == 60
        more = [(a, f"n{i}".encode()) for i in range(20)]
        await publisher.publish_many(more)
        got = await receive(sub, 80)
        assert len(got) == 80
        for channel in (a, b):
            sent = [data for c, data in batch + more if c == channel]
            assert [m.data for m in got if m.channel == channel] == sent

    async def test_empty_batch_publishes_nothing(self, publisher: FanoutPublisher) -> None:
        assert await publisher.publish_many([]) == 0

    async def test_binary_payload_arrives_unchanged(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a = f"{prefix}:a"
        sub = await open_subscription(a)
        payload = bytes(range(256)) + '{"é": "ü"}'.encode()
        await publisher.publish_many([(a, payload)])
        assert await receive(sub, 1) == [Message(a, payload)]

    async def test_several_subscribers_each_get_every_message(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a = f"{prefix}:a"
        subs = [await open_subscription(a) for _ in range(3)]
        sent = [(a, f"m{i}".encode()) for i in range(10)]
        await publisher.publish_many(sent)
        for sub in subs:
            assert [(m.channel, m.data) for m in await receive(sub, 10)] == sent

    async def test_unsubscribe_stops_delivery(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a, b = f"{prefix}:a", f"{prefix}:b"
        sub = await open_subscription(a, b)
        await sub.unsubscribe(a)
        # Messages on their way when it unsubscribed may still arrive: go one round trip past.
        await publisher.publish_many([(b, b"marker-1")])
        await receive_until(sub, Message(b, b"marker-1"))
        await publisher.publish_many([(a, b"after"), (b, b"marker-2")])
        assert await receive_until(sub, Message(b, b"marker-2")) == [Message(b, b"marker-2")]

    async def test_subscribe_later_to_more_channels(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a, b = f"{prefix}:a", f"{prefix}:b"
        sub = await open_subscription(a)
        await sub.subscribe(b)
        await subscribed(sub, b)
        await publisher.publish_many([(b, b"b1"), (a, b"a1")])
        assert await receive(sub, 2) == [Message(b, b"b1"), Message(a, b"a1")]

    async def test_nothing_is_stored_for_later_subscribers(
        self,
        publisher: FanoutPublisher,
        open_subscription: Callable[..., Awaitable[Subscription]],
        prefix: str,
    ) -> None:
        a = f"{prefix}:a"
        await publisher.publish_many([(a, b"before")])
        sub = await open_subscription(a)
        await publisher.publish_many([(a, b"after")])
        assert await receive_until(sub, Message(a, b"after")) == [Message(a, b"after")]

    # -- connection loss -----------------------------------------------------------------

    async def test_reestablished_after_the_server_drops_the_connection(
        self,
        publisher: FanoutPublisher,
        subscriber: FanoutSubscriber,
        drop: Drop,
        prefix: str,
    ) -> None:
        """After a drop, the subscription says :class:`Subscribed` again (re-established in
        place), or raises :class:`FanoutUnavailable` (then a new one is opened); either way
        publishing works again afterwards."""
        a = f"{prefix}:a"
        sub = subscriber.subscription()
        await sub.subscribe(a)
        await subscribed(sub, a)
        await drop()

        async def again() -> bool:
            nonlocal sub
            try:
                event = await sub.next(timeout=0.2)
            except FanoutUnavailable:
                await sub.close()
                sub = subscriber.subscription()
                await sub.subscribe(a)
                return False
            assert not isinstance(event, Message)
            return isinstance(event, Subscribed)

        await eventually(again, "the subscription re-established after the drop", WITHIN_S)
        try:
            await publisher.publish_many([(a, b"after the drop")])
            assert await receive(sub, 1) == [Message(a, b"after the drop")]
        finally:
            await sub.close()

    async def test_publish_to_a_dead_server_is_unavailable(
        self, dead_publisher: FanoutPublisher, prefix: str
    ) -> None:
        with pytest.raises(FanoutUnavailable):
            await dead_publisher.publish_many([(f"{prefix}:a", b"lost")])
        with pytest.raises(FanoutUnavailable):
            await dead_publisher.ping()

    async def test_close_is_idempotent(self, subscriber: FanoutSubscriber, prefix: str) -> None:
        sub = subscriber.subscription()
        await sub.subscribe(f"{prefix}:a")
        await sub.close()
        await sub.close()
