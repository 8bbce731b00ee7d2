"""The maintenance role: partitions ahead, event retention with floors, outbox and inbox purges.

One round, under a session advisory lock so that any number of replicas do the work once (a
replica that does not get the lock skips the round; a replica that dies releases it with its
connection):

1. partitions for today and ``partitions_ahead_days`` ahead (``ensure_partitions``);
2. every partition older than ``event_retention``: floors raised, detached, dropped
   (``aivedio.retention.partitions``; the order is what keeps cursors honest); then every
   closed day not packed yet gets its indexes rebuilt full (``compact``);
3. published outbox rows older than ``outbox_retention``, in batches;
4. processed inbox rows received before ``callback_dedup_window``, in batches (their dedup keys
   go: a later duplicate is absorbed by the state machine, never applied twice).

Why batches for the outbox and not partitions (measured by ``aivedio bench retention``, see
docs/reference/benchmarks.md): the outbox is a queue whose rows are published within
milliseconds, so its live size is a day of rows at most; deleting them by primary key in
batches of 1,000 costs a few ms per batch and never takes a lock that a writer or the relay
waits for, while a partitioned outbox would put the partition key into the relay's claim and
its per-task ordering index for a gain that only counts at sizes the outbox never reaches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
from prometheus_client import Counter, Histogram

from aivedio.db.pool import UNAVAILABLE_ERRORS, Database, unavailable
from aivedio.db.queries import q
from aivedio.logs import log
from aivedio.process.rounds import run_rounds
from aivedio.retention.config import RetentionConfig
from aivedio.retention.partitions import (
    compact,
    compactable,
    detach_and_drop,
    droppable,
    ensure_partitions,
    ident,
    list_partitions,
    raise_floors,
)

__all__ = ["LOCK_KEY", "Maintenance", "RoundResult", "purge_batches"]

logger = logging.getLogger("aivedio.maintenance")

LOCK_KEY = 0x52455445  # "RETE": one maintenance round at a time, cluster-wide

ACTIONS = Counter(
    "aivedio_maintenance_actions_total",
    "Maintenance work done, by kind (partitions_created, partitions_dropped, floors_raised, "
    "partitions_compacted, outbox_deleted, inbox_deleted, rounds_skipped)",
    ["kind"],
)
DROP_SECONDS = Histogram(
    "aivedio_maintenance_partition_drop_seconds",
    "Floors raised, detached and dropped: one task_events partition",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


@dataclass
class RoundResult:
    skipped: bool = False  # another replica holds the lock
    partitions_created: int = 0
    partitions_dropped: list[str] = field(default_factory=list)
    floors_raised: int = 0
    partitions_compacted: list[str] = field(default_factory=list)
    outbox_deleted: int = 0
    inbox_deleted: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "skipped": self.skipped,
            "partitions_created": self.partitions_created,
            "partitions_dropped": self.partitions_dropped,
            "floors_raised": self.floors_raised,
            "partitions_compacted": self.partitions_compacted,
            "outbox_deleted": self.outbox_deleted,
            "inbox_deleted": self.inbox_deleted,
        }


async def purge_batches(conn: asyncpg.Connection, query: str, cutoff: datetime, batch: int) -> int:
    """Run a ``purge_*_batch`` query page after page (each its own transaction) until a page is
    empty or holds a row younger than ``cutoff``; the rows deleted."""
    after, deleted = 0, 0
    while True:
        row = await conn.fetchrow(q(query), after, batch, cutoff)
        assert row is not None
        deleted += int(row["deleted"])
        if row["last_id"] is None or row["young"]:
            return deleted
        after = row["last_id"]


class Maintenance:
    def __init__(
        self,
        db: Database,
        config: RetentionConfig | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.db = db
        self.config = config or RetentionConfig()
        self.clock = clock

    async def run(self, stopping: asyncio.Event) -> None:
        await asyncio.sleep(random.uniform(0, min(self.config.interval_s, 5.0)))

        async def one_round() -> int:
            result = await self.run_once()
            if result.partitions_dropped or result.outbox_deleted or result.inbox_deleted:
                log(logger, logging.INFO, "maintenance round", **result.as_dict())
            return 0  # periodic: always pause

        await run_rounds(stopping, one_round, self.config.interval_s, logger, "maintenance")

    async def run_once(self) -> RoundResult:
        conn = await self.db.session()  # session advisory lock, DETACH CONCURRENTLY: no pool
        try:
            return await self._locked_round(conn)
        except UNAVAILABLE_ERRORS as exc:
            raise unavailable(exc) from exc
        finally:
            await _close(conn)

    async def _locked_round(self, conn: asyncpg.Connection) -> RoundResult:
        if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
            ACTIONS.labels("rounds_skipped").inc()
            return RoundResult(skipped=True)
        try:
            return await self._round(conn)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", LOCK_KEY)

    async def _round(self, conn: asyncpg.Connection) -> RoundResult:
        cfg, now = self.config, self.clock()
        result = RoundResult()
        result.partitions_created = await ensure_partitions(conn, cfg.partitions_ahead_days)
        ACTIONS.labels("partitions_created").inc(result.partitions_created)
        for partition in droppable(await list_partitions(conn), now - cfg.event_retention):
            began = time.perf_counter()
            result.floors_raised += await raise_floors(conn, partition.name, cfg.batch_size)
            await detach_and_drop(conn, partition, cfg.detach_timeout_s)
            DROP_SECONDS.observe(time.perf_counter() - began)
            result.partitions_dropped.append(partition.name)
            log(logger, logging.INFO, "event partition dropped", partition=partition.name)
        for row in await conn.fetch(q("detached_event_tables")):
            await conn.execute(f"DROP TABLE {ident(row['name'])}")
            result.partitions_dropped.append(row["name"])
            log(logger, logging.INFO, "detached event table dropped", table=row["name"])
        ACTIONS.labels("partitions_dropped").inc(len(result.partitions_dropped))
        ACTIONS.labels("floors_raised").inc(result.floors_raised)
        if cfg.compact:
            closed = now - timedelta(minutes=10)  # past the bound: no row arrives any more
            for partition in await compactable(conn, await list_partitions(conn), closed):
                await compact(conn, partition)
                result.partitions_compacted.append(partition.name)
            ACTIONS.labels("partitions_compacted").inc(len(result.partitions_compacted))
        result.outbox_deleted = await purge_batches(
            conn, "purge_outbox_batch", now - cfg.outbox_retention, cfg.batch_size
        )
        ACTIONS.labels("outbox_deleted").inc(result.outbox_deleted)
        result.inbox_deleted = await purge_batches(
            conn, "purge_inbox_batch", now - cfg.callback_dedup_window, cfg.batch_size
        )
        ACTIONS.labels("inbox_deleted").inc(result.inbox_deleted)
        return result


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 5.0)
    except Exception:
        conn.terminate()
