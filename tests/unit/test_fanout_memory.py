"""The fan-out contract against the in-memory fake (which must behave like Redis Pub/Sub)."""

from __future__ import annotations

import pytest

from aivedio.fanout import FanoutPublisher, FanoutSubscriber, FanoutUnavailable
from aivedio.fanout.memory import MemoryFanout
from tests.contract.fanout_contract import Drop, FanoutContract, subscribed


class TestMemoryFanout(FanoutContract):
    @pytest.fixture
    def server(self) -> MemoryFanout:
        return MemoryFanout()

    @pytest.fixture
    def publisher(self, server: MemoryFanout) -> FanoutPublisher:
        return server

    @pytest.fixture
    def subscriber(self, server: MemoryFanout) -> FanoutSubscriber:
        return server

    @pytest.fixture
    def drop(self, server: MemoryFanout) -> Drop:
        async def drop() -> None:
            server.drop_connections()

        return drop

    @pytest.fixture
    def dead_publisher(self) -> FanoutPublisher:
        dead = MemoryFanout()
        dead.set_available(False)
        return dead


async def test_an_outage_ends_live_subscriptions() -> None:
    """The fake's outage (used by unit tests of the callers): live subscriptions raise, new ones
    cannot subscribe until the server is back."""
    server = MemoryFanout()
    sub = server.subscription()
    await sub.subscribe("c")
    await subscribed(sub, "c")
    server.set_available(False)
    with pytest.raises(FanoutUnavailable):
        await sub.next(timeout=0)
    with pytest.raises(FanoutUnavailable):
        await server.subscription().subscribe("c")
    server.set_available(True)
    again = server.subscription()
    await again.subscribe("c")
    await subscribed(again, "c")
    await server.publish_many([("c", b"back")])
    assert (await again.next(timeout=1.0)) is not None
