"""Inbox rows that cannot be processed now: when they are tried again, how that is counted and
logged, and the operator's functions for dead letters (``aivedio inbox dead-letters`` /
``aivedio inbox replay ID``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg
from prometheus_client import Counter

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.ingest.prepare import Defer, InboxRecord
from aivedio.logs import log

__all__ = ["backoff_s", "list_dead_letters", "record_deferral", "replay"]

logger = logging.getLogger("aivedio.ingest.processor")  # the processor's log lines

ORPHANS = Counter(
    "aivedio_inbox_orphans_total",
    "Inbox rows that could not be mapped to an attempt this time (retried with backoff)",
    ["provider", "reason"],
)
RETRIES = Counter(
    "aivedio_inbox_retries_total",
    "Inbox rows deferred for a parse or re-fetch failure",
    ["provider", "reason"],
)
DEAD_LETTERS = Counter(
    "aivedio_inbox_dead_letters_total",
    "Inbox rows moved to dead letter after their last try",
    ["provider", "reason"],
)


def backoff_s(
    tries: int, base_s: float, cap_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Delay before try ``tries + 1``: ``min(cap, base * 2^(tries-1)) * uniform(0.8, 1.2)``."""
    exponent = max(0, tries - 1)
    delay = cap_s if exponent >= 64 else min(cap_s, base_s * 2.0**exponent)
    return delay * (0.8 + 0.4 * rand())


def record_deferral(
    row: InboxRecord, defer: Defer, status: str, delay: float, result: asyncpg.Record
) -> None:
    """Count and log a deferral the database took (``result``: the row as ``inbox_defer`` left
    it, dead or waiting for its next try)."""
    provider = row["provider"]
    if result["process_status"] == "dead":
        DEAD_LETTERS.labels(provider, defer.code).inc()
        log(
            logger,
            logging.WARNING,
            "inbox row dead-lettered",
            inbox_id=row["id"],
            provider=provider,
            code=defer.code,
            tries=result["retry_count"],
        )
    elif status == "orphan":
        ORPHANS.labels(provider, defer.code).inc()
        log(
            logger,
            logging.INFO,
            "inbox row orphaned",
            inbox_id=row["id"],
            provider=provider,
            code=defer.code,
            tries=result["retry_count"],
            retry_in_s=round(delay, 3),
        )
    else:
        RETRIES.labels(provider, defer.code).inc()
        log(
            logger,
            logging.WARNING,
            "inbox row deferred",
            inbox_id=row["id"],
            provider=provider,
            code=defer.code,
            tries=result["retry_count"],
        )


async def list_dead_letters(db: Database, limit: int = 50) -> list[dict[str, Any]]:
    """The newest dead letters, without payloads (the sample is redacted)."""
    async with db.connection() as conn:
        rows = await conn.fetch(q("inbox_dead_letters"), limit)
    return [
        {
            key: (value.isoformat() if isinstance(value, datetime) else value)
            for key, value in row.items()
        }
        for row in rows
    ]


async def replay(db: Database, inbox_id: int) -> bool:
    """Requeue one dead (or waiting orphan / retry) row now with a fresh try budget. False when
    there is no such row or it was already processed."""
    async with db.connection() as conn:
        return await conn.fetchval(q("inbox_replay"), inbox_id) is not None
