"""One group-commit batch in the database: the ``INSERT_BATCH`` statement and its one JSON
parameter, the slot's held connection that runs it (:class:`Held`), and the expiry of processed
payloads.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import orjson

from aivedio.db.pool import UNAVAILABLE_ERRORS, Database
from aivedio.errors import DatabaseUnavailable
from aivedio.ingest.inbox_row import InboxRow
from aivedio.logs import log

__all__ = ["EXPIRE_PAYLOADS", "INSERT_BATCH", "Held", "batch_json", "expire_processed_payloads"]

logger = logging.getLogger("aivedio.ingest")

# The batch travels as ONE parameter, JSON text read as jsonb (text: the pool's jsonb codec would
# encode the string again): an array of rows, each an array in this column order, the stored
# payload spliced in as a JSON value (not a string), so PostgreSQL parses it once, with the
# rest. Against 14 typed array parameters (unnest), measured: asyncpg spent ~5 us of CPU per row
# encoding the arrays (timestamps, text, bytea), orjson ~1 us here; the callback server's CPU
# per callback went from 86 to 76 us at the max rate (bench ingest, two server processes).
_COLUMNS = (
    ("provider", "r->>0"),
    ("dedup_key", "r->>1"),
    ("provider_event_id", "r->>2"),
    ("provider_task_id", "r->>3"),
    ("client_request_id", "r->>4"),
    ("provider_occurred_at", "(r->>5)::timestamptz"),
    ("received_at", "(r->>6)::timestamptz"),
    ("signature_key_version", "r->>7"),
    ("payload_hash", "decode(r->>8, 'hex')"),
    ("payload", "nullif(r->9, 'null'::jsonb)"),  # JSON null -> SQL NULL (no payload kept)
    ("trace_id", "r->>10"),
    ("event_type", "r->>11"),
    ("attempt_id", "r->>12"),
    ("payload_authenticated", "(r->>13)::boolean"),
)

# $2 and $3: the lease of a handoff (aivedio.db.handoff), both NULL without one: the rows are
# stored already claimed by the inbox processor of this process, which takes them from memory.
INSERT_BATCH = """
INSERT INTO provider_callback_inbox ({names}, lease_token, lease_until)
SELECT {selected}, $2::uuid, now() + make_interval(secs => $3::float8)
FROM jsonb_array_elements($1::text::jsonb) AS r
ON CONFLICT (provider, dedup_key) DO NOTHING
RETURNING id, provider, dedup_key
""".format(
    names=", ".join(name for name, _ in _COLUMNS),
    selected=", ".join(expression for _, expression in _COLUMNS),
)

EXPIRE_PAYLOADS = """
UPDATE provider_callback_inbox SET payload = NULL
WHERE process_status = 'processed' AND payload IS NOT NULL AND processed_at < $1
"""


def batch_json(rows: list[InboxRow]) -> str:
    """The ``INSERT_BATCH`` parameter: ``[[provider, dedup_key, ..., payload, ...], ...]``.

    One ``orjson.dumps`` for the batch, the payload's own JSON text spliced in as a
    ``Fragment`` (already serialized by the adapter: not parsed, not re-encoded); timestamps as
    RFC 3339, the hash in hex (0.8 us per row against 1.6 for two dumps per row joined). A
    payload that is not valid JSON makes PostgreSQL refuse the batch, and the writer then
    inserts its rows one by one, as for any refused row."""
    return orjson.dumps(
        [
            [
                r.provider,
                r.dedup_key,
                r.provider_event_id,
                r.provider_task_id,
                r.client_request_id,
                r.provider_occurred_at,
                r.received_at,
                r.signature_key_version,
                r.payload_hash.hex(),
                None if r.payload_json is None else orjson.Fragment(r.payload_json),
                r.trace_id,
                r.event_type,
                r.attempt_id,
                r.payload_authenticated,
            ]
            for r in rows
        ],
        option=orjson.OPT_NAIVE_UTC,  # as asyncpg sent a naive datetime: UTC
    ).decode()


def _alive(conn: asyncpg.Connection) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # the pool took it back when its session ended
        return False


class Held:
    """A slot's pooled connection, kept from one batch to the next and given back after a while
    without rows (``_HOLD_IDLE_S`` of :mod:`.group_commit`): an acquire and a release per batch
    (asyncpg's pool: a timeout, a shielded task) were a third of the writer's CPU for a one-row
    batch (a one-off profile of the writer alone)."""

    __slots__ = ("conn", "db")

    def __init__(self, db: Database) -> None:
        self.db = db
        self.conn: asyncpg.Connection | None = None

    async def insert(
        self, rows: list[InboxRow], lease: tuple[uuid.UUID, float] | None = None
    ) -> dict[tuple[str, str], int]:
        """``INSERT_BATCH`` of ``rows`` (leased ``(token, seconds)`` when given), committed on
        return; the keys it inserted and their row ids.

        A connection that fails is given back (the pool replaces it). When it was a held one
        (its session may have ended while it waited: a server restart, a terminated backend),
        the batch is tried once more on a new connection: ``ON CONFLICT DO NOTHING`` makes
        the second try safe whether or not the first committed."""
        batch = batch_json(rows)
        token, lease_s = lease if lease is not None else (None, None)
        reused = self.conn is not None and _alive(self.conn)
        try:
            return await self._fetch(batch, token, lease_s)
        except DatabaseUnavailable as exc:
            if not reused:
                raise
            log(logger, logging.WARNING, "inbox connection lost; once more on a new one",
                error=str(exc))  # fmt: skip
        return await self._fetch(batch, token, lease_s)

    async def _fetch(
        self, batch: str, token: uuid.UUID | None, lease_s: float | None
    ) -> dict[tuple[str, str], int]:
        conn = self.conn
        if conn is not None and not _alive(conn):
            await self.release()
            conn = None
        if conn is None:
            conn = self.conn = await self.db.acquire()
        try:
            records = await conn.fetch(INSERT_BATCH, batch, token, lease_s)
        except asyncpg.PostgresError as exc:
            if isinstance(exc, UNAVAILABLE_ERRORS):  # e.g. terminated by an administrator
                await self.discard()
                raise DatabaseUnavailable(f"PostgreSQL unavailable: {type(exc).__name__}") from exc
            raise  # the database refused the statement: the session itself is fine
        except Exception as exc:  # the connection failed (lost, timed out, driver state)
            await self.discard()
            raise DatabaseUnavailable(f"PostgreSQL unavailable: {type(exc).__name__}") from exc
        except BaseException:  # cancelled mid-statement: the session's state is unknown
            await self.release()
            raise
        return {(r["provider"], r["dedup_key"]): r["id"] for r in records}

    async def release(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.db.release(conn)

    async def discard(self) -> None:
        """Give back a connection that failed: terminated, never reused by the pool."""
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.db.discard(conn)


async def expire_processed_payloads(db: Database, older_than: timedelta) -> int:
    """Null the ``payload`` of rows processed more than ``older_than`` ago; the number nulled.

    The row itself stays (its dedup key keeps absorbing late duplicates, its hash stays for
    audits); only the provider's content goes. Called by the reconciler on a schedule."""
    async with db.connection() as conn:
        status = await conn.execute(EXPIRE_PAYLOADS, datetime.now(UTC) - older_than)
    return int(status.rsplit(" ", 1)[-1])
