"""The media consumer: durable group ``media`` on ``task.status``. On ``provider_succeeded`` it
inserts one media operation row (UNIQUE per task, attempt and operation type, so a redelivered
message is a no-op) and acks after the commit. Media workers do the work."""

from __future__ import annotations

import asyncio
import logging
import uuid

from prometheus_client import Counter

from aivedio.bus.port import Bus
from aivedio.consumers import TOPIC, StatusEvent, consume
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.statuses import Status
from aivedio.logs import log
from aivedio.media.config import MediaConfig

logger = logging.getLogger("aivedio.media")

INGEST = "ingest"  # the one operation type: fetch, store, probe, render, publish

OPERATIONS_CREATED = Counter(
    "aivedio_media_operations_created_total",
    "Media operations created, by result (created or duplicate)",
    ["result"],
)


class MediaConsumer:
    def __init__(self, db: Database, config: MediaConfig | None = None) -> None:
        self.db = db
        self.config = config or MediaConfig()

    async def handle(self, event: StatusEvent) -> None:
        if event.status != Status.PROVIDER_SUCCEEDED or event.attempt_id is None:
            return
        async with self.db.connection() as conn:
            created = await conn.fetchval(
                q("insert_media_operation"),
                uuid.uuid4(),
                event.attempt_id,
                INGEST,
                uuid.uuid4(),
                event.trace_id,
            )
        OPERATIONS_CREATED.labels("created" if created else "duplicate").inc()
        if created:
            log(logger, logging.INFO, "media operation created", task_id=str(event.task_id))

    async def run(self, bus: Bus, stopping: asyncio.Event) -> None:
        """Consume until ``stopping`` is set. The bus belongs to the caller."""
        consumer = await bus.subscribe(TOPIC, self.config.group)
        try:
            await consume(consumer, self.handle, stopping, self.config.consumer, logger)
        finally:
            await consumer.close()
