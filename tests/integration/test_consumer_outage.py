"""A bus consumer (billing here; media shares the loop) during a PostgreSQL outage: it holds its
deliveries in progress and retries, so an outage longer than ``max_deliver`` redeliveries
dead-letters nothing; once the database is back every event is handled once."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

import pytest

from aivedio.billing import BillingConfig, BillingConsumer
from aivedio.bus.jetstream import JetStreamBus
from aivedio.config import DatabaseConfig
from aivedio.consumers import ConsumerSettings
from aivedio.db.pool import Database
from aivedio.state.service import StateService
from tests.contract.bus_contract import contract_config
from tests.integration.consumer_helpers import publish_outbox, running
from tests.integration.helpers import make_project
from tests.integration.test_api_database_down import via
from tests.integration.test_billing import PRICES, kinds, ledger, succeeded_task
from tests.integration.test_bus_jetstream import _delete_streams
from tests.proxy import TcpProxy
from tests.waiting import eventually


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[JetStreamBus]:
    # Two deliveries at most, and a short ack wait: a nak per failed try, or a delivery left
    # to time out, would dead-letter the events within a couple of seconds of outage.
    cfg = replace(contract_config(nats_url), max_deliver=2, ack_wait_s=1.0)
    connected = await JetStreamBus.connect(cfg)
    yield connected
    await connected.close()
    await _delete_streams(nats_url, cfg)


async def test_a_database_outage_holds_the_deliveries_and_dead_letters_nothing(
    db: Database, database_url: str, bus: JetStreamBus, caplog: pytest.LogCaptureFixture
) -> None:
    project = await make_project(db)
    task_id = await succeeded_task(StateService(db), project)
    await publish_outbox(db, bus)
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    cut = await Database.connect(
        DatabaseConfig(url=via(database_url, proxy.port), min_size=0, acquire_timeout_s=0.5)
    )
    config = BillingConfig(
        prices=PRICES, consumer=ConsumerSettings(batch=50, fetch_timeout_s=0.2, retry_delay_s=0.2)
    )
    consumer = BillingConsumer(cut, config)
    try:
        await proxy.cut()  # away before the first event is handled
        with caplog.at_level(logging.WARNING, logger="aivedio.billing"):
            async with running(lambda stop: consumer.run(bus, stop)):

                async def held_long() -> bool:
                    # Twenty tries 0.2 s apart: longer than max_deliver x ack_wait.
                    tries = [r for r in caplog.records if "holding the delivery" in r.getMessage()]
                    return len(tries) >= 20

                await eventually(held_long, timeout=60, what="the consumer to hold and retry")
                assert await ledger(db, task_id) == []
                await proxy.start()

                async def charged() -> bool:
                    return len(await ledger(db, task_id)) >= 2

                await eventually(charged, timeout=60, what="the ledger once the database is back")
        assert kinds(await ledger(db, task_id)) == [("reserve", 250), ("settle", 250)]
        assert await bus.dead_letters("billing") == []
        assert not [r for r in caplog.records if "will be redelivered" in r.getMessage()]
    finally:
        await proxy.cut()
        await cut.close()
