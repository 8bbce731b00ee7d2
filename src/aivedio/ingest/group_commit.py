"""Group commit into ``provider_callback_inbox``: many callbacks, one INSERT, one commit.

Each callback request hands its row to :meth:`InboxWriter.submit` and waits (or to
:meth:`InboxWriter.enqueue` with a function to call once the row's fate is known). One background
task (the flusher) takes whatever is queued, up to ``max_batch`` rows, as soon as one of its
``max_inflight`` slots is free (after lingering ``linger_s`` for more, when set), and inserts
them all with ONE statement::

    INSERT INTO provider_callback_inbox (...)
    SELECT r->>0, r->>1, ... FROM jsonb_array_elements($1::text::jsonb) AS r
    ON CONFLICT (provider, dedup_key) DO NOTHING RETURNING provider, dedup_key

Up to ``max_inflight`` batches are in flight at once, each on its own pool connection (kept from
batch to batch, given back after a second without rows), so the next batch does not wait for the
previous one's WAL flush (the queue behind a slow commit keeps moving).

The statement runs outside an explicit transaction, so it is committed (``synchronous_commit`` as
configured on the server, ``on`` by default: flushed to the WAL) when it returns. Only then is each
waiter given its own :class:`Outcome`: ``NEW`` when its key came back from
RETURNING, ``DUPLICATE`` when the key was already stored (or appeared earlier in the same batch).
Nothing is ever answered before its batch committed.

Failures: a batch that meets :class:`~aivedio.errors.DatabaseUnavailable` fails every waiter in it
with that error (the gateway answers 503; the commit may or may not have happened, which is safe:
the provider retries and dedup absorbs the copy). Any other PostgreSQL error (a row the database
refuses) makes the flusher insert that batch's rows one by one, so the bad row alone fails with
:class:`InboxError` and the others get their true outcome. A full queue fails at once with
:class:`InboxFull`; a closed writer with :class:`InboxClosed`.

Rows are sorted by ``(provider, dedup_key)`` inside a batch, so concurrent batches (several
gateway replicas) take the unique-index locks in one order and cannot deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

import asyncpg
import orjson
from prometheus_client import Gauge, Histogram

from aivedio.db.handoff import HandedRow, Handoff
from aivedio.db.pool import UNAVAILABLE_ERRORS, Database
from aivedio.errors import AivedioError, DatabaseUnavailable
from aivedio.logs import log

__all__ = [
    "GroupCommitConfig",
    "InboxClosed",
    "InboxError",
    "InboxFull",
    "InboxRow",
    "InboxWriter",
    "Outcome",
    "expire_processed_payloads",
]

logger = logging.getLogger("aivedio.ingest")

BATCH_SIZE = Histogram(
    "aivedio_callback_inbox_batch_size",
    "Rows per group-commit INSERT into provider_callback_inbox",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
INSERT_SECONDS = Histogram(
    "aivedio_callback_inbox_insert_seconds",
    "Duration of one group-commit INSERT (acquire, insert, commit)",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0),
)
STORE_SECONDS = Histogram(
    "aivedio_callback_store_seconds",
    "Per callback: its inbox row built (receipt, verified) -> committed by its group commit",
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0),
)
QUEUE_DEPTH = Gauge(
    "aivedio_callback_inbox_queue_depth", "Callbacks waiting for the next group commit"
)
_WRITERS: weakref.WeakSet[InboxWriter] = weakref.WeakSet()
# Read when scraped (the queues of this process's live writers), not written per callback.
QUEUE_DEPTH.set_function(lambda: float(sum(writer.queued for writer in list(_WRITERS))))


class Outcome(StrEnum):
    NEW = "new"
    """The row was inserted and committed by this batch."""
    DUPLICATE = "duplicate"
    """A row with this (provider, dedup_key) was already committed; nothing changed."""


class InboxError(AivedioError):
    """The database refused this row (not an outage): the gateway answers 500."""


class InboxFull(AivedioError):
    """The queue is at its bound: the gateway answers 503 at once rather than queue further."""


class InboxClosed(AivedioError):
    """The writer is shutting down and takes no more rows (503)."""


@dataclass(slots=True, kw_only=True)
class InboxRow:
    """One callback as stored. ``payload_json`` is the minimized payload, already serialized as
    one JSON document (the gateway's parse guarantees it; the batch splices it in as is).
    (Not frozen: a frozen dataclass's ``__init__`` costs 2x, once per callback; never changed
    after it is built all the same.)"""

    provider: str
    dedup_key: str
    payload_hash: bytes
    payload_json: str | None
    received_at: datetime
    provider_event_id: str | None = None
    provider_task_id: str | None = None
    client_request_id: str | None = None
    provider_occurred_at: datetime | None = None
    signature_key_version: str | None = None
    event_type: str | None = None
    attempt_id: str | None = None
    payload_authenticated: bool = True
    trace_id: str | None = None


@dataclass(frozen=True, slots=True)
class GroupCommitConfig:
    max_batch: int = 512
    """Most rows in one INSERT."""
    linger_s: float = 0.0
    """How long the flusher waits for more rows when a batch is not full and a slot is free.
    0: a free slot takes what is queued at once; rows batch by themselves while the
    ``max_inflight`` batches commit. ``aivedio bench ingest`` measured 2 ms of linger at 8,890
    callbacks/s, p50 7.2 ms, and none at 12,493/s, p50 5.1 ms (64 connections): waiting for
    a fuller batch only delayed the commit, it never saved one the database needed."""
    max_queue: int = 10_000
    """Most rows waiting; beyond it ``submit`` raises :class:`InboxFull`."""
    drain_timeout_s: float = 10.0
    """How long ``close`` lets the flusher commit what is queued."""
    max_inflight: int = 2
    """Batches being inserted at once, each on its own pool connection: the next batch does not
    wait for the previous one's commit (WAL flush), so a slow commit delays one batch, not the
    queue behind it. 1: one batch after the other."""


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


def _utc(at: datetime | None) -> datetime | None:
    """As PostgreSQL gives a timestamptz back: aware (a naive one is UTC, as the batch sent it)."""
    return at.replace(tzinfo=UTC) if at is not None and at.tzinfo is None else at


def handed_row(row: InboxRow, inbox_id: int) -> HandedRow:
    """A stored row as the inbox processor's claim would have returned it (``inbox_claim``)."""
    return {
        "id": inbox_id,
        "provider": row.provider,
        "dedup_key": row.dedup_key,
        "provider_event_id": row.provider_event_id,
        "provider_task_id": row.provider_task_id,
        "client_request_id": row.client_request_id,
        "provider_occurred_at": _utc(row.provider_occurred_at),
        "received_at": _utc(row.received_at),
        "payload": None if row.payload_json is None else orjson.loads(row.payload_json),
        "process_status": "pending",
        "retry_count": 0,
        "event_type": row.event_type,
        "attempt_id": row.attempt_id,
        "payload_authenticated": row.payload_authenticated,
        "trace_id": row.trace_id,
    }


def _batch_json(rows: list[InboxRow]) -> str:
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


_UNENCODABLE = re.compile(r"[\x00\ud800-\udfff]")


def _check_row(row: InboxRow) -> None:
    """Refuse, alone, a row the driver could not even send (NUL, lone surrogates): such a row
    must never reach a batch, where its encoding error would fail every other row with it."""
    text = "".join(
        (
            row.provider,
            row.dedup_key,
            row.payload_json or "",
            row.provider_event_id or "",
            row.provider_task_id or "",
            row.client_request_id or "",
            row.signature_key_version or "",
            row.trace_id or "",
            row.event_type or "",
            row.attempt_id or "",
        )
    )
    if text.isascii() and "\x00" not in text:  # the common case: two scans, no regex
        return
    if _UNENCODABLE.search(text):
        raise InboxError("the callback holds text PostgreSQL cannot store")


Done = Callable[[Outcome | BaseException], None]
"""What :meth:`InboxWriter.enqueue` calls once a row's batch is over: its :class:`Outcome` after
the commit, or the error that failed it (never before the commit, exactly once)."""


@dataclass(slots=True, eq=False)
class _Waiter:
    row: InboxRow
    done: Done
    settled: bool = False


def _settle(waiter: _Waiter, outcome: Outcome | BaseException) -> None:
    if waiter.settled:  # a batch cut short (cancelled) after some of its waiters were told
        return
    waiter.settled = True
    try:
        waiter.done(outcome)
    except Exception as exc:  # the receiver's bug: never the rest of the batch's
        log(logger, logging.ERROR, "inbox waiter failed", error=type(exc).__name__)


def _resolver(future: asyncio.Future[Outcome]) -> Done:
    def resolve(outcome: Outcome | BaseException) -> None:
        if future.done():  # the request went away (client disconnect, timeout)
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    return resolve


class InboxWriter:
    """Queue + one flusher task. ``start()`` once, ``await close()`` at shutdown."""

    def __init__(
        self,
        db: Database,
        config: GroupCommitConfig | None = None,
        *,
        on_stored: Callable[[], None] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self.db = db
        self.config = config or GroupCommitConfig()
        self._on_stored = on_stored
        """Called after a batch committed new rows (wakes the inbox processor of this process)."""
        self._handoff = handoff
        """Where new rows go, stored already leased, while an inbox processor of this process
        takes them from memory (aivedio.db.handoff); without one the processors claim them."""
        self._queue: deque[_Waiter] = deque()
        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The flusher's loop, kept: asyncio.get_running_loop() makes a getpid() system call
        # (glibc no longer caches it), which was 3 % of the callback server's CPU per submit.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._held: list[_Held] = []  # the slots' connections
        _WRITERS.add(self)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the flusher on the running event loop."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="inbox-group-commit")

    async def close(self) -> None:
        """Refuse new rows, commit what is queued (bounded by ``drain_timeout_s``), stop."""
        self._closing = True
        self._wakeup.set()
        self._full.set()
        task, self._task = self._task, None
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), self.config.drain_timeout_s)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        while self._queue:  # never started, or the drain timed out
            _settle(self._queue.popleft(), InboxClosed("the inbox writer is closed"))

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- the request side -------------------------------------------------------------------

    async def submit(self, row: InboxRow) -> Outcome:
        """Queue ``row`` and wait until its batch committed; its own outcome, or an error:
        :class:`DatabaseUnavailable`, :class:`InboxError`, :class:`InboxFull`,
        :class:`InboxClosed`."""
        loop = self._loop
        if loop is None:
            raise InboxClosed("the inbox writer is not running")
        future: asyncio.Future[Outcome] = loop.create_future()
        self.enqueue(row, _resolver(future))
        return await future

    def enqueue(self, row: InboxRow, done: Done) -> None:
        """Queue ``row``; the flusher calls ``done(outcome)`` once its batch committed, or
        ``done(error)`` (:class:`DatabaseUnavailable`, :class:`InboxError`,
        :class:`InboxClosed`) if it could not be. Raises :class:`InboxFull`,
        :class:`InboxClosed` or :class:`InboxError` at once instead of queuing.

        :meth:`submit` without a future: the lean HTTP path answers from ``done`` itself, one
        call per callback where a future costs a loop callback and a coroutine step more."""
        task = self._task
        if self._closing or task is None or task.done():  # done: a flusher that died, never a hang
            raise InboxClosed("the inbox writer is not running")
        queue = self._queue
        if len(queue) >= self.config.max_queue:
            raise InboxFull("the callback inbox queue is full")
        _check_row(row)
        queue.append(_Waiter(row, done))
        self._wakeup.set()
        if len(queue) >= self.config.max_batch:
            self._full.set()

    # -- the flusher ------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._held = [_Held(self.db) for _ in range(max(1, self.config.max_inflight))]
        slots = [
            loop.create_task(self._slot(held), name=f"inbox-group-commit-slot-{n}")
            for n, held in enumerate(self._held)
        ]
        try:
            await asyncio.gather(*slots)
        except asyncio.CancelledError:
            for slot in slots:
                slot.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            raise

    async def _slot(self, held: _Held) -> None:
        """One of the ``max_inflight`` slots: a batch at a time, taken as soon as it is free."""
        queue = self._queue
        try:
            while True:
                if not queue:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    if held.conn is None:
                        await self._wakeup.wait()
                        continue
                    try:  # idle for a while: the connection goes back to the pool
                        async with asyncio.timeout(_HOLD_IDLE_S):
                            await self._wakeup.wait()
                    except TimeoutError:
                        await held.release()
                    continue
                linger = self.config.linger_s
                if linger > 0 and len(queue) < self.config.max_batch and not self._closing:
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._full.wait(), linger)
                    if not queue:  # another slot took them meanwhile
                        continue
                count = min(len(queue), self.config.max_batch)
                await self._flush_batch([queue.popleft() for _ in range(count)], held)
        finally:
            await held.release()

    async def _flush_batch(self, batch: list[_Waiter], held: _Held) -> None:
        """Insert one batch and settle its waiters, whatever happens (never raises but for
        cancellation, which settles them as closed)."""
        try:
            await self._flush(batch, held)
        except asyncio.CancelledError:
            for waiter in batch:
                _settle(waiter, InboxClosed("the inbox writer was stopped"))
            raise
        except Exception as exc:  # never let the flusher die; fail this batch only
            log(logger, logging.ERROR, "inbox batch failed", error=type(exc).__name__)
            await held.discard()
            for waiter in batch:
                _settle(waiter, InboxError("the callback could not be stored"))

    async def _flush(self, batch: list[_Waiter], held: _Held) -> None:
        # First occurrence of each key is inserted; later ones in the batch are duplicates.
        first: dict[tuple[str, str], _Waiter] = {}
        repeats: list[_Waiter] = []
        for waiter in batch:
            key = (waiter.row.provider, waiter.row.dedup_key)
            if key in first:
                repeats.append(waiter)
            else:
                first[key] = waiter
        unique = [first[key] for key in sorted(first)]
        BATCH_SIZE.observe(len(unique))
        handoff = self._handoff
        lease = handoff.lease() if handoff is not None else None
        started = time.perf_counter()
        try:
            inserted = await held.insert([w.row for w in unique], lease)
        except DatabaseUnavailable as exc:
            log(logger, logging.WARNING, "inbox batch: database unavailable", rows=len(batch))
            for waiter in batch:
                _settle(waiter, DatabaseUnavailable(str(exc)))
            return
        except asyncpg.PostgresError as exc:
            log(logger, logging.WARNING, "inbox batch refused; rows one by one", error=exc.sqlstate)
            await self._flush_one_by_one(unique, repeats, held)
            return
        finally:
            INSERT_SECONDS.observe(time.perf_counter() - started)
        if inserted and handoff is not None and lease is not None:
            handoff.put(
                lease[0],
                [handed_row(first[key].row, inbox_id) for key, inbox_id in inserted.items()],
            )
        if inserted and self._on_stored is not None:
            self._on_stored()
        committed = time.time()
        for waiter in batch:
            STORE_SECONDS.observe(max(0.0, committed - waiter.row.received_at.timestamp()))
        for key, waiter in first.items():
            _settle(waiter, Outcome.NEW if key in inserted else Outcome.DUPLICATE)
        for waiter in repeats:
            _settle(waiter, Outcome.DUPLICATE)

    async def _flush_one_by_one(
        self, unique: list[_Waiter], repeats: list[_Waiter], held: _Held
    ) -> None:
        failed: dict[tuple[str, str], BaseException] = {}
        for waiter in unique:
            key = (waiter.row.provider, waiter.row.dedup_key)
            try:
                inserted = await held.insert([waiter.row])
            except DatabaseUnavailable as exc:
                failed[key] = DatabaseUnavailable(str(exc))
            except asyncpg.PostgresError as exc:
                log(logger, logging.ERROR, "inbox row refused", sqlstate=exc.sqlstate)
                failed[key] = InboxError("the callback could not be stored")
            else:
                if inserted and self._on_stored is not None:
                    self._on_stored()
                _settle(waiter, Outcome.NEW if key in inserted else Outcome.DUPLICATE)
                continue
            _settle(waiter, failed[key])
        for waiter in repeats:
            key = (waiter.row.provider, waiter.row.dedup_key)
            _settle(waiter, failed.get(key, Outcome.DUPLICATE))


def _alive(conn: asyncpg.Connection) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # the pool took it back when its session ended
        return False


_HOLD_IDLE_S = 1.0
"""How long a slot keeps its connection without a row to insert."""


class _Held:
    """A slot's pooled connection, kept from one batch to the next and given back after
    ``_HOLD_IDLE_S`` without rows: an acquire and a release per batch (asyncpg's pool: a
    timeout, a shielded task) were a third of the writer's CPU for a one-row batch (a one-off
    profile of the writer alone)."""

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
        batch = _batch_json(rows)
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
