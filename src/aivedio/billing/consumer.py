"""The billing consumer: durable group ``billing`` on ``task.status``; one transaction per message,
acked only after it committed."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from aivedio.billing.config import BillingConfig
from aivedio.billing.ledger import record
from aivedio.bus.port import Bus
from aivedio.consumers import TOPIC, StatusEvent, consume
from aivedio.db.pool import Database
from aivedio.logs import log

logger = logging.getLogger("aivedio.billing")

LEDGER_ENTRIES = Counter(
    "aivedio_billing_ledger_entries_total", "Credit ledger rows written", ["ledger_type"]
)
BILLING_EVENTS = Counter(
    "aivedio_billing_events_total", "task.status events the billing consumer handled"
)


class BillingConsumer:
    def __init__(self, db: Database, config: BillingConfig | None = None) -> None:
        self.db = db
        self.config = config or BillingConfig()

    async def handle(self, event: StatusEvent) -> None:
        """Idempotent: a redelivered event writes nothing new."""
        async with self.db.transaction() as conn:
            written = await record(conn, event, self.config.prices)
        BILLING_EVENTS.inc()
        for entry in written:
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

    async def run(self, bus: Bus, stopping: asyncio.Event) -> None:
        """Consume until ``stopping`` is set. The bus belongs to the caller."""
        consumer = await bus.subscribe(TOPIC, self.config.group)
        try:
            await consume(consumer, self.handle, stopping, self.config.consumer, logger)
        finally:
            await consumer.close()
