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

The row and the writer's errors are in :mod:`.inbox_row`; the statement, its parameter and the
slots' held connections in :mod:`.inbox_batch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg
from prometheus_client import Gauge, Histogram

from aivedio.db.handoff import Handoff
from aivedio.db.pool import Database
from aivedio.errors import DatabaseUnavailable
from aivedio.ingest.inbox_batch import Held
from aivedio.ingest.inbox_row import (
    InboxClosed,
    InboxError,
    InboxFull,
    InboxRow,
    Outcome,
    check_row,
    handed_row,
)
from aivedio.logs import log

__all__ = ["GroupCommitConfig", "InboxWriter"]

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
        self._held: list[Held] = []  # the slots' connections
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
        check_row(row)
        queue.append(_Waiter(row, done))
        self._wakeup.set()
        if len(queue) >= self.config.max_batch:
            self._full.set()

    # -- the flusher ------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._held = [Held(self.db) for _ in range(max(1, self.config.max_inflight))]
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

    async def _slot(self, held: Held) -> None:
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

    async def _flush_batch(self, batch: list[_Waiter], held: Held) -> None:
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

    async def _flush(self, batch: list[_Waiter], held: Held) -> None:
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
        if inserted and handoff is not None:
            if lease is not None:
                handoff.put(
                    lease[0],
                    [handed_row(first[key].row, inbox_id) for key, inbox_id in inserted.items()],
                )
            else:
                handoff.stored_in_table()
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
        self, unique: list[_Waiter], repeats: list[_Waiter], held: Held
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
                if inserted and self._handoff is not None:
                    self._handoff.stored_in_table()
                if inserted and self._on_stored is not None:
                    self._on_stored()
                _settle(waiter, Outcome.NEW if key in inserted else Outcome.DUPLICATE)
                continue
            _settle(waiter, failed[key])
        for waiter in repeats:
            key = (waiter.row.provider, waiter.row.dedup_key)
            _settle(waiter, failed.get(key, Outcome.DUPLICATE))


_HOLD_IDLE_S = 1.0
"""How long a slot keeps its connection without a row to insert."""
