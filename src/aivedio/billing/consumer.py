"""The billing consumer: durable group ``billing`` on ``task.status``; one transaction per message,
acked only after it committed."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict

from prometheus_client import Counter

from aivedio.billing.config import BillingConfig
from aivedio.billing.ledger import LedgerType, entry_for, record
from aivedio.bus.port import Bus
from aivedio.consumers import TOPIC, StatusEvent, consume
from aivedio.db.pool import Database
from aivedio.logs import log

logger = logging.getLogger("aivedio.billing")

LEDGER_ENTRIES = Counter(
    "aivedio_billing_ledger_entries_total", "Credit ledger rows written", ["ledger_type"]
)
BILLING_EVENTS = Counter(
    "aivedio_billing_events_total",
    "task.status events the billing consumer handled: recorded (a transaction) or skipped (a "
    "reserve-class event of an attempt whose reservation is known to exist)",
    ["result"],
)


class BillingConsumer:
    def __init__(self, db: Database, config: BillingConfig | None = None) -> None:
        self.db = db
        self.config = config or BillingConfig()
        # Attempts whose reservation is known to exist: their later reserve-class events (every
        # progress event of a running task) can write nothing, so they take no transaction. A
        # transaction per progress event was billing's whole cost: 519 us of CPU and 199 us of
        # PostgreSQL per event in bench e2e (split=1, 1,000/s). Bounded; a restart forgets it.
        self._reserved: OrderedDict[uuid.UUID, None] = OrderedDict()

    async def handle(self, event: StatusEvent) -> None:
        """Idempotent: a redelivered event writes nothing new."""
        attempt = event.attempt_id
        wanted = entry_for(event.status)
        if wanted is LedgerType.RESERVE and attempt is not None and attempt in self._reserved:
            self._reserved.move_to_end(attempt)
            BILLING_EVENTS.labels("skipped").inc()
            return
        async with self.db.transaction() as conn:
            recorded = await record(conn, event, self.config.prices)
        BILLING_EVENTS.labels("recorded").inc()
        if attempt is not None and recorded.reserved:
            self._remember(attempt, closed=wanted is not LedgerType.RESERVE)
        for entry in recorded.written:
            LEDGER_ENTRIES.labels(str(entry.ledger_type)).inc()
            log(
                logger,
                logging.INFO,
                "ledger entry",
                task_id=str(event.task_id),
                attempt_id=str(event.attempt_id),
                ledger_type=str(entry.ledger_type),
                amount=entry.amount,
            )

    def _remember(self, attempt: uuid.UUID, *, closed: bool) -> None:
        if closed:  # settled or refunded: no more events of it are expected
            self._reserved.pop(attempt, None)
            return
        self._reserved[attempt] = None
        self._reserved.move_to_end(attempt)
        while len(self._reserved) > self.config.remember_attempts:
            self._reserved.popitem(last=False)

    async def run(self, bus: Bus, stopping: asyncio.Event) -> None:
        """Consume until ``stopping`` is set. The bus belongs to the caller."""
        consumer = await bus.subscribe(TOPIC, self.config.group)
        try:
            await consume(consumer, self.handle, stopping, self.config.consumer, logger)
        finally:
            await consumer.close()
