"""The bus contract against the in-memory fake (which must behave like JetStream)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from aivedio.bus import Bus
from aivedio.bus.memory import MemoryBroker, MemoryBus
from tests.contract.bus_contract import BusContract, BusFactory, contract_config


class TestMemoryBus(BusContract):
    @pytest.fixture
    async def bus_factory(self) -> AsyncIterator[BusFactory]:
        cfg = contract_config()
        broker = MemoryBroker()
        buses: list[Bus] = []

        async def factory() -> Bus:
            bus = MemoryBus(cfg, broker)
            buses.append(bus)
            return bus

        yield factory
        for bus in buses:
            await bus.close()
