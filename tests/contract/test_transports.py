"""The transport contract run on every ``Transport``: SSE and WebSocket over real sockets through
the real HTTP front door, and the recording fake the session tests use."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.transport_contract import Link, TransportContract
from tests.contract.transport_links import FakeLink, SseLink, WsLink, front_door


class TestSseTransport(TransportContract):
    @pytest.fixture
    async def link(self) -> AsyncIterator[Link]:
        async with front_door() as (port, acceptor):
            link = await SseLink.open(port, acceptor)
            try:
                yield link
            finally:
                await link.aclose()


class TestWsTransport(TransportContract):
    @pytest.fixture
    async def link(self) -> AsyncIterator[Link]:
        async with front_door() as (port, acceptor):
            link = await WsLink.open(port, acceptor)
            try:
                yield link
            finally:
                await link.aclose()


class TestRecordingTransport(TransportContract):
    @pytest.fixture
    def link(self) -> Link:
        return FakeLink()
