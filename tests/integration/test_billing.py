"""The billing consumer on real PostgreSQL: reserve / settle / refund, redelivery never charges
twice, the per-tenant balance view. Consumer logic runs on the in-memory bus (the JetStream
adapter passes the same contract); one end-to-end test runs on real JetStream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from aivedio.billing import BillingConfig, BillingConsumer, PriceTable, tenant_balance
from aivedio.billing.ledger import LedgerType, closing_for, entry_for
from aivedio.bus.jetstream import JetStreamBus
from aivedio.bus.memory import MemoryBroker, MemoryBus
from aivedio.consumers import ConsumerSettings, parse_status_event
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, ProviderStatus
from aivedio.state.service import StateService
from tests.contract.bus_contract import contract_config
from tests.integration.consumer_helpers import (
    AckLoser,
    apply_all,
    platform,
    prov,
    publish_outbox,
    running,
)
from tests.integration.helpers import Project, make_project, make_task, store
from tests.integration.test_bus_jetstream import _delete_streams
from tests.waiting import eventually

PRICES = PriceTable({"sandbox/m1": 250, "sandbox/*": 90}, default=40)
CONFIG = BillingConfig(
    prices=PRICES, consumer=ConsumerSettings(batch=50, fetch_timeout_s=0.2, retry_delay_s=0.2)
)


async def ledger(db: Database, task_id: uuid.UUID) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return [dict(r.items()) for r in await conn.fetch(q("ledger_of_task"), task_id)]


def kinds(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(r["ledger_type"], r["amount"]) for r in rows]


@pytest.fixture
def memory_bus() -> MemoryBus:
    return MemoryBus(replace(contract_config(), ack_wait_s=0.3, max_deliver=20), MemoryBroker())


async def succeeded_task(state: StateService, project: Project, **kw: Any) -> uuid.UUID:
    task_id, attempt = await make_task(store(state.db, state), project, **kw)
    await apply_all(
        state,
        [
            platform(PlatformKind.SUBMIT_ACCEPTED, attempt),
            prov(attempt, ProviderStatus.RUNNING, progress=10, provider_sequence=2),
            prov(attempt, ProviderStatus.SUCCEEDED, provider_sequence=3),
            platform(PlatformKind.MEDIA_STAGE, attempt, stage="ingesting"),
            platform(PlatformKind.MEDIA_READY, attempt, asset_id=uuid.uuid4()),
        ],
    )
    return task_id


async def failed_task(state: StateService, project: Project, *, accepted: bool) -> uuid.UUID:
    task_id, attempt = await make_task(store(state.db, state), project, model="m2")
    if accepted:
        await apply_all(
            state,
            [
                platform(PlatformKind.SUBMIT_ACCEPTED, attempt),
                prov(attempt, ProviderStatus.FAILED, error_code="generation_failed"),
            ],
        )
    else:
        await apply_all(state, [platform(PlatformKind.SUBMIT_REJECTED, attempt)])
    return task_id


async def canceled_task(state: StateService, project: Project) -> uuid.UUID:
    task_id, attempt = await make_task(store(state.db, state), project, provider="sandbox")
    await apply_all(
        state,
        [
            platform(PlatformKind.SUBMIT_ACCEPTED, attempt),
            prov(attempt, ProviderStatus.QUEUED, provider_sequence=1),
            platform(PlatformKind.CANCEL_REQUESTED, attempt),
            prov(attempt, ProviderStatus.CANCELED, provider_sequence=2),
        ],
    )
    return task_id


@pytest.fixture
async def billing(db: Database, memory_bus: MemoryBus) -> AsyncIterator[BillingConsumer]:
    consumer = BillingConsumer(db, CONFIG)
    async with running(lambda stop: consumer.run(memory_bus, stop)):
        yield consumer


async def settled(db: Database, task_id: uuid.UUID, n: int) -> None:
    async def enough() -> bool:
        return len(await ledger(db, task_id)) >= n

    await eventually(enough, what=f"{n} ledger rows")


async def test_reserve_then_settle_once_each_under_three_redeliveries(
    db: Database, memory_bus: MemoryBus, billing: BillingConsumer
) -> None:
    state = StateService(db)
    project = await make_project(db)
    task_id = await succeeded_task(state, project)
    published = await publish_outbox(db, memory_bus, copies=4)  # the first + 3 redeliveries
    assert published == 6
    await settled(db, task_id, 2)
    await asyncio.sleep(0.5)  # let every copy be handled; a second charge would show now
    rows = await ledger(db, task_id)
    assert kinds(rows) == [("reserve", 250), ("settle", 250)]
    assert {r["provider"] for r in rows} == {"sandbox"} and {r["model"] for r in rows} == {"m1"}
    assert rows[0]["task_version"] == 2  # written by the `submitted` event
    balance = await tenant_balance(db, project.tenant_id)
    assert (balance.reserved, balance.settled, balance.refunded) == (250, 250, 0)
    assert (balance.held, balance.spent, balance.entries) == (0, 250, 2)


async def test_refund_on_failed_and_canceled_only_after_a_reservation(
    db: Database, memory_bus: MemoryBus, billing: BillingConsumer
) -> None:
    state = StateService(db)
    project = await make_project(db)
    failed = await failed_task(state, project, accepted=True)
    rejected = await failed_task(state, project, accepted=False)
    canceled = await canceled_task(state, project)
    in_flight, attempt = await make_task(store(db, state), project, model="m9")
    await apply_all(state, [platform(PlatformKind.SUBMIT_ACCEPTED, attempt)])
    await publish_outbox(db, memory_bus, copies=3)
    await settled(db, failed, 2)
    await settled(db, canceled, 2)
    await settled(db, in_flight, 1)
    await asyncio.sleep(0.5)
    assert kinds(await ledger(db, failed)) == [("reserve", 90), ("refund", 90)]
    assert kinds(await ledger(db, canceled)) == [("reserve", 250), ("refund", 250)]
    assert kinds(await ledger(db, in_flight)) == [("reserve", 90)]
    assert await ledger(db, rejected) == []  # never accepted: a refund without reserve is a no-op
    balance = await tenant_balance(db, project.tenant_id)
    assert (balance.reserved, balance.settled, balance.refunded) == (430, 0, 340)
    assert (balance.held, balance.spent) == (90, 0)
    other = await tenant_balance(db, uuid.uuid4())
    assert (other.reserved, other.held, other.entries) == (0, 0, 0)


async def test_a_reservation_that_arrives_after_the_failure_is_closed_at_once(
    db: Database,
) -> None:
    state = StateService(db)
    project = await make_project(db)
    task_id = await failed_task(state, project, accepted=True)
    consumer = BillingConsumer(db, CONFIG)
    bus = MemoryBus(contract_config(), MemoryBroker())
    await publish_outbox(db, bus)
    group = await bus.subscribe("task.status", "billing")
    deliveries = await group.fetch(10, 0.5)
    events = [parse_status_event(d.data) for d in deliveries]
    by_status = {e.status: e for e in events if e is not None}
    await consumer.handle(by_status["failed"])  # the failure first: nothing reserved yet
    assert await ledger(db, task_id) == []
    await consumer.handle(by_status["submitted"])  # a late (redelivered) reservation
    assert kinds(await ledger(db, task_id)) == [("reserve", 90), ("refund", 90)]
    await consumer.handle(by_status["failed"])
    await consumer.handle(by_status["submitted"])
    assert len(await ledger(db, task_id)) == 2


async def test_ready_without_a_seen_reservation_reserves_and_settles(db: Database) -> None:
    state = StateService(db)
    project = await make_project(db)
    task_id = await succeeded_task(state, project)
    bus = MemoryBus(contract_config(), MemoryBroker())
    await publish_outbox(db, bus)
    group = await bus.subscribe("task.status", "billing")
    events = [parse_status_event(d.data) for d in await group.fetch(10, 0.5)]
    ready = next(e for e in events if e is not None and e.status == "ready")
    await BillingConsumer(db, CONFIG).handle(ready)
    assert kinds(await ledger(db, task_id)) == [("reserve", 250), ("settle", 250)]


async def test_progress_events_after_the_reservation_take_no_transaction(db: Database) -> None:
    state = StateService(db)
    project = await make_project(db)
    task_id, attempt = await make_task(store(db, state), project)
    await apply_all(
        state,
        [platform(PlatformKind.SUBMIT_ACCEPTED, attempt)]
        + [
            prov(attempt, ProviderStatus.RUNNING, progress=10 * n, provider_sequence=n)
            for n in range(1, 5)
        ],
    )
    bus = MemoryBus(contract_config(), MemoryBroker())
    await publish_outbox(db, bus)
    group = await bus.subscribe("task.status", "billing")
    events = [parse_status_event(d.data) for d in await group.fetch(20, 0.5)]
    reserving = [e for e in events if e is not None and e.status in ("submitted", "running")]
    assert len(reserving) >= 4
    consumer = BillingConsumer(db, CONFIG)

    def skipped() -> float:
        value = REGISTRY.get_sample_value("aivedio_billing_events_total", {"result": "skipped"})
        return value or 0.0

    before = skipped()
    for event in reserving:
        await consumer.handle(event)
    assert skipped() - before == len(reserving) - 1  # only the first one asked the database
    assert kinds(await ledger(db, task_id)) == [("reserve", 250)]
    # a new consumer (a restart) knows nothing: it asks once, and writes nothing twice
    await BillingConsumer(db, CONFIG).handle(reserving[-1])
    assert kinds(await ledger(db, task_id)) == [("reserve", 250)]


async def test_poison_message_is_dead_lettered_and_the_rest_go_on(
    db: Database, memory_bus: MemoryBus, billing: BillingConsumer
) -> None:
    state = StateService(db)
    project = await make_project(db)
    await memory_bus.publish("task.status", "k", "poison-1", b"{not json")
    task_id = await succeeded_task(state, project)
    await publish_outbox(db, memory_bus)
    await settled(db, task_id, 2)

    async def dead() -> bool:
        return len(await memory_bus.dead_letters("billing")) == 1

    await eventually(dead, what="the poison message in the dead letters")
    (letter,) = await memory_bus.dead_letters("billing")
    assert letter.dedup_id == "poison-1" and letter.reason.startswith("invalid event")


async def test_end_to_end_on_jetstream_with_lost_acks(db: Database, nats_url: str) -> None:
    """Real JetStream: each message's ack is lost 3 times, so the broker delivers it 4 times."""
    cfg = replace(contract_config(nats_url), ack_wait_s=1.0, max_deliver=10)
    bus = await JetStreamBus.connect(cfg)
    try:
        state = StateService(db)
        project = await make_project(db)
        ok = await succeeded_task(state, project)
        failed = await failed_task(state, project, accepted=True)
        await publish_outbox(db, bus)
        handled: dict[str, int] = {}
        losing = AckLoser(bus, lose=3, handled=handled)
        consumer = BillingConsumer(db, CONFIG)
        async with running(lambda stop: consumer.run(losing, stop)):  # type: ignore[arg-type]

            async def redelivered() -> bool:
                return len(handled) == 9 and all(n >= 4 for n in handled.values())

            await eventually(redelivered, timeout=30, what="4 deliveries of each of 9 messages")
        assert kinds(await ledger(db, ok)) == [("reserve", 250), ("settle", 250)]
        assert kinds(await ledger(db, failed)) == [("reserve", 90), ("refund", 90)]
        balance = await tenant_balance(db, project.tenant_id)
        assert (balance.reserved, balance.settled, balance.refunded, balance.held) == (
            340,
            250,
            90,
            0,
        )
    finally:
        await bus.close()
        await _delete_streams(nats_url, cfg)


def test_entry_for_each_status() -> None:
    assert entry_for("submitted") is LedgerType.RESERVE
    assert entry_for("running") is LedgerType.RESERVE
    assert entry_for("provider_succeeded") is LedgerType.RESERVE
    assert entry_for("ready") is LedgerType.SETTLE
    assert entry_for("failed") is LedgerType.REFUND
    assert entry_for("canceled") is LedgerType.REFUND
    for status in ("created", "submit_unknown", "status_unknown", "cancel_requested", "nope"):
        assert entry_for(status) is None
    assert closing_for("ready", True) is LedgerType.SETTLE
    assert closing_for("running", True) is None
    assert closing_for("running", False) is LedgerType.REFUND


def test_price_table() -> None:
    assert PRICES.price("sandbox", "m1") == 250
    assert PRICES.price("sandbox", "other") == 90
    assert PRICES.price("acme", "m1") == 40
    with pytest.raises(ValueError, match="provider/model"):
        PriceTable({"nokey": 1})
