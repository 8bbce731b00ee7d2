"""Partitions of ``task_events``: made ahead, dropped after the retention, floors first.

The order that keeps every cursor honest (docs/explanation/retention.md):

1. **Raise the floors.** For each stream (a few per transaction), ``floor`` becomes the highest
   seq of the stream's current epoch stored in the partition, if that is above the floor.
2. **Detach** the partition (``DETACH PARTITION ... CONCURRENTLY``: SHARE UPDATE EXCLUSIVE on
   ``task_events``, so no writer and no reader waits), finalizing a detach that was interrupted.
3. **Drop** the detached table (it is no partition any more: no lock on ``task_events``).

Why "highest seq dropped" and not "lowest seq kept": a stream's seqs and its rows' times agree
only as far as clocks do; with the highest dropped seq, every seq above the floor is in a
partition that is still there, whatever the clocks did. The gateway resets a cursor below the
floor (``event: reset``) and replays one at or above it completely. An interruption anywhere
(a SIGKILL between 1 and 2, or in the middle of 1) leaves floors raised over rows still stored:
extra resets at most, never a silent partial replay. The next round does the rest.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from aivedio.db.queries import q

__all__ = [
    "Partition",
    "compact",
    "compactable",
    "detach_and_drop",
    "droppable",
    "ensure_partitions",
    "list_partitions",
    "raise_floors",
]

_NAME = re.compile(r"^task_events_[a-z0-9_]+$")

_RAISE_FLOORS = """
WITH page AS (
    SELECT project_id, epoch FROM event_streams
    WHERE project_id > $1
    ORDER BY project_id
    LIMIT $2
), top AS (
    SELECT p.project_id, p.epoch,
           (SELECT max(e.seq) FROM {table} e
            WHERE e.project_id = p.project_id AND e.epoch = p.epoch) AS top
    FROM page p
), raised AS (
    UPDATE event_streams s SET floor = t.top, updated_at = now()
    FROM top t
    WHERE s.project_id = t.project_id AND s.epoch = t.epoch AND s.floor < t.top
    RETURNING s.project_id
)
SELECT (SELECT project_id FROM page ORDER BY project_id DESC LIMIT 1) AS last_id,
       (SELECT count(*) FROM raised) AS raised
"""

_INDEXES = """
SELECT c.relname AS name, i.indisvalid AS valid,
       COALESCE('fillfactor=100' = ANY (c.reloptions), false) AS packed
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = $1::regclass
ORDER BY c.relname
"""


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    upper_bound: datetime | None  # None: unbounded above (never dropped)
    detach_pending: bool


def ident(name: str) -> str:
    """A partition's name as an SQL identifier (names come from the catalog, and are checked)."""
    if not _NAME.match(name):
        raise ValueError(f"not a task_events partition name: {name!r}")
    return f'"{name}"'


async def ensure_partitions(conn: asyncpg.Connection, ahead_days: int) -> int:
    """Create today's and the next ``ahead_days`` days' partitions that are missing."""
    made: int = await conn.fetchval(q("ensure_event_partitions"), ahead_days)
    return made


async def list_partitions(conn: asyncpg.Connection) -> list[Partition]:
    rows = await conn.fetch(q("event_partitions"))
    return [Partition(r["name"], r["upper_bound"], r["detach_pending"]) for r in rows]


def droppable(partitions: list[Partition], cutoff: datetime) -> list[Partition]:
    """The partitions whose every row is older than ``cutoff``, oldest first. The newest
    partition is never dropped (writes need somewhere to go)."""
    bounded = [p for p in partitions if p.upper_bound is not None]
    newest = max((p.upper_bound for p in bounded if p.upper_bound), default=None)
    return [
        p
        for p in bounded
        if p.upper_bound is not None and p.upper_bound <= cutoff and p.upper_bound != newest
    ]


async def raise_floors(
    conn: asyncpg.Connection, partition: str, batch: int, after: uuid.UUID | None = None
) -> int:
    """Step 1 for one partition: raise every stream's floor to the highest seq (of its current
    epoch) that the partition holds. ``batch`` streams per transaction, so a writer waits for
    a stream row at most one short transaction; returns how many floors moved."""
    sql = _RAISE_FLOORS.format(table=ident(partition))
    cursor = after or uuid.UUID(int=0)
    raised = 0
    while True:
        row = await conn.fetchrow(sql, cursor, batch)
        assert row is not None
        raised += int(row["raised"])
        if row["last_id"] is None:
            return raised
        cursor = row["last_id"]


async def detach_and_drop(conn: asyncpg.Connection, partition: Partition, timeout_s: float) -> None:
    """Steps 2 and 3. ``conn`` must not be in a transaction (DETACH ... CONCURRENTLY runs two of
    its own). A detach interrupted before (``detach_pending``) is finalized instead."""
    table = ident(partition.name)
    if partition.detach_pending:
        await conn.execute(f"ALTER TABLE task_events DETACH PARTITION {table} FINALIZE")
    else:
        await conn.execute(
            f"ALTER TABLE task_events DETACH PARTITION {table} CONCURRENTLY", timeout=timeout_s
        )
    await conn.execute(f"DROP TABLE {table}")


async def compactable(
    conn: asyncpg.Connection, partitions: list[Partition], before: datetime
) -> list[Partition]:
    """Closed partitions (no row can arrive any more: the upper bound is before ``before``)
    whose indexes were not packed yet."""
    found = []
    for p in partitions:
        if p.upper_bound is None or p.upper_bound > before or p.detach_pending:
            continue
        indexes = await conn.fetch(_INDEXES, ident(p.name))
        if not all(r["valid"] and r["packed"] for r in indexes):
            found.append(p)
    return found


async def compact(conn: asyncpg.Connection, partition: Partition) -> None:
    """Rebuild a closed partition's indexes packed full (fillfactor 100): they were built by
    inserts at several points of the key space at once (one per stream, and random task ids),
    which leaves pages about half full; a day that no longer changes can be packed. REINDEX
    ... CONCURRENTLY blocks no writer or reader (SHARE UPDATE EXCLUSIVE on the partition only).
    An index an interrupted rebuild left invalid is dropped first. ``conn`` outside a
    transaction."""
    table = ident(partition.name)
    for row in await conn.fetch(_INDEXES, table):
        if not row["valid"]:
            await conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{row["name"]}"')
        elif not row["packed"]:
            await conn.execute(f'ALTER INDEX "{row["name"]}" SET (fillfactor = 100)')
    await conn.execute(f"REINDEX TABLE CONCURRENTLY {table}")
