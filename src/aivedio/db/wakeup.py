"""Wake an idle consumer of a table within a millisecond of new work, never after a sleep.

Two paths, both ending in :meth:`IdleListener.sleep`:

In-process
    A producer in the same process calls :meth:`IdleListener.kick` after its commit, through a
    :class:`Signal` of the process's runtime (the callbacks' group commit kicks the inbox
    processor of its process; the inbox processor the outbox relay).
Across processes: LISTEN/NOTIFY, gated by an advisory lock
    NOTIFY takes a cluster-wide lock at commit that serialises every committing transaction that
    notified (measured on the outbox: it halved applied observations/s), so writers notify only
    while a consumer sleeps. A consumer about to sleep takes advisory lock ``lock_key``
    exclusively (session level) on its listening connection, re-checks for work, and waits for
    a notification. A writer's statement trigger tries to take the lock shared for its
    transaction: if that fails, a consumer sleeps (or is about to) and the writer notifies; if
    it succeeds, no consumer sleeps, nothing is sent, and the shared lock held until commit keeps
    a consumer from falling asleep before the writer's rows are visible (the consumer's re-check
    runs once it holds the lock). Migrations 0003 (outbox) and 0009 (callback inbox) hold the
    triggers; docs/explanation/propagation.md the argument.

Two consumers of one table (a relay, or an inbox processor, in each of two processes)
    Only one can sleep holding the lock. The other only tries to take it; if a sleeping
    consumer holds it (exclusively: a shared try fails too), writers are notifying already, so
    it sleeps listening without the lock, after a re-check, and a kick or a notification wakes
    it; if writers hold it (shared, until they commit), it waits ``LOCK_WAIT_MS`` or for a
    kick, then looks for work.
    It used to wait for the lock, which a sleeper holds for up to ``poll_s``, deaf to kicks the
    whole time: a callback handed to its inbox processor in memory, which no other processor
    can see, then waited up to 0.5 s (``bench e2e``, two ``--role all`` processes: p99 about
    500 ms at 20 and at 500 webhooks/s); then at most ``LOCK_WAIT_MS``, still deaf, which became
    the wait of most wake-ups once writers that kick their own consumer stopped notifying
    (migration 0018): at 100 webhooks/s the `applied` and `relayed` stages grew from 1-3 to
    9-11 ms p50.

Writers whose consumer is woken in memory do not notify (migration 0018): callbacks stored leased
to the inbox processor of their process (aivedio.db.handoff), and the inbox processor's apply
transactions while an outbox relay of its process listens to its ``Signal``. Their notifications
woke every sleeping consumer of both processes for rows that were another's.

A kick is never lost: ``sleep`` returns at once when one came since the consumer last woke (the
event is cleared when a sleep ends, just before the consumer looks for work), whatever the sleep
was doing meanwhile (waiting for the lock's release or for a connection).

A poll every ``poll_s`` is the safety net: a lost listening connection, rows whose retry became
due, writers that kept the lock shared past ``LOCK_WAIT_MS`` with no consumer asleep (the
consumer looks again at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg

from aivedio.db.pool import UNAVAILABLE_ERRORS, Database
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log

__all__ = ["DB_ERRORS", "LOCK_WAIT_MS", "IdleListener", "Signal", "wait_any"]

LOCK_WAIT_MS = 20
"""How long a consumer about to sleep, finding the idle lock held by writers only, waits (or
until a kick) before it looks for work again: longer than a writer's transaction holds it
shared, far shorter than a sleeping consumer holds it."""

_TRY_LOCK = """
SELECT CASE
    WHEN pg_try_advisory_lock($1) THEN 'taken'
    WHEN pg_try_advisory_lock_shared($1) THEN
        CASE WHEN pg_advisory_unlock_shared($1) THEN 'writers' END
    ELSE 'sleeper'
END
"""
"""One round trip: take the idle lock; else tell who holds it. Only a sleeping consumer holds
it exclusively, so a shared try fails against it and succeeds (and is given back at once)
when only writers hold it, shared until they commit. CASE evaluates its branches in order and
only as far as needed. (It read ``pg_locks`` before, in a second statement: at 100 webhooks/s
the costliest statement but one, about 0.3 ms of execution each.)"""

logger = logging.getLogger("aivedio.db.wakeup")

# What the listening connection may raise when PostgreSQL misbehaves or goes away.
DB_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    asyncpg.PostgresError,
    *UNAVAILABLE_ERRORS,
)


async def wait_any(
    stopping: asyncio.Event,
    timeout: float,  # noqa: ASYNC109 - a wait bounded by it, not a cancellation scope
    wake: asyncio.Event | None = None,
) -> None:
    """Sleep up to ``timeout``; return early when ``stopping`` (or ``wake``) is set."""
    events = [stopping] if wake is None else [stopping, wake]
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


class Signal:
    """An in-process wake-up between the roles of one process: producers ``fire()`` after they
    committed new work, consumers ``subscribe(listener.kick)``. Firing with no subscriber (the
    consumer runs in another process) costs a loop over an empty list."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    @property
    def subscribed(self) -> bool:
        """Whether a consumer of this process listens (a fire would reach it)."""
        return bool(self._subscribers)

    def fire(self) -> None:
        for callback in self._subscribers:
            callback()


class IdleListener:
    """The sleep of one consumer: ``await sleep(stopping)`` after a round that found no work.

    ``has_work_sql`` answers whether a round would find something now (ignoring row locks);
    ``name`` appears in log lines.
    """

    def __init__(
        self,
        db: Database,
        *,
        channel: str,
        lock_key: int,
        has_work_sql: str,
        poll_s: float,
        name: str,
    ) -> None:
        self.db = db
        self.channel = channel
        self.lock_key = lock_key
        self.has_work_sql = has_work_sql
        self.poll_s = poll_s
        self.name = name
        self._wake = asyncio.Event()
        self._listener: asyncpg.Connection | None = None
        self._unlocking: asyncio.Future[str] | None = None  # the lock's release, in flight
        self._busy_rechecks = 0  # re-checks that saw work another consumer then held
        self._table_hint = False  # see table_hint
        self.waits = 0
        """How many times the consumer began waiting for a wake-up (tests wait for it)."""

    def kick(self) -> None:
        """New work committed in this process: wake the sleeper now (no-op when awake)."""
        self._wake.set()

    def worked(self) -> None:
        """The consumer's last round found work."""
        self._busy_rechecks = 0

    def table_hint(self) -> bool:
        """Whether the table may hold work that no kick announced, since the last call (which
        clears it): a notification came, a re-check found work, writers held the lock (they
        write rows that notify), or the listening connection was lost (notifications may have
        been missed). A consumer whose kicks bring its work in memory (the inbox processor with
        a handoff) looks at the table only then, or when its own poll is due."""
        hint, self._table_hint = self._table_hint, False
        return hint

    async def nap(self, stopping: asyncio.Event, timeout: float) -> bool:  # noqa: ASYNC109
        """Wait up to ``timeout`` for a kick (or a notification to the listening connection)
        without a statement: whether one came (then the consumer looks for work at once). A
        busy consumer naps between rounds instead of taking the idle lock and re-checking for
        work each time: its process's commits kick it anyway."""
        if not self._wake.is_set():
            await wait_any(stopping, timeout, self._wake)
        return self._kicked()

    async def sleep(self, stopping: asyncio.Event) -> None:
        """Wait for a kick, a NOTIFY or ``poll_s``, holding the idle lock (or listening while
        another consumer holds it); see the module doc. Returns at once after a kick that came
        since the last sleep ended."""
        if self._kicked():
            return
        if self._unlocking is not None:
            unlocking, self._unlocking = self._unlocking, None
            try:
                await unlocking
            except DB_ERRORS as exc:
                self._lost(exc)
                await self._drop()
        listener = await self._connect()
        if self._kicked():
            return
        if listener is None:  # deaf to notifications: the table must be looked at
            self._table_hint = True
            await self._wait(stopping)
            return
        try:
            # Not waited for: another consumer may be asleep holding it, or in-flight writers
            # hold it shared until they commit (_sleep_beside waits for a kick meanwhile, which
            # a statement waiting for the lock could not).
            holder = await listener.fetchval(_TRY_LOCK, self.lock_key)
        except DB_ERRORS as exc:
            self._lost(exc)
            await self._drop()
            return
        if holder != "taken":
            await self._sleep_beside(listener, stopping, sleeper=holder == "sleeper")
            return
        try:
            # A writer that committed before we held the lock did not notify: look once more.
            work = self._wake.is_set() or self._found(await listener.fetchval(self.has_work_sql))
            if work:
                await listener.execute("SELECT pg_advisory_unlock($1)", self.lock_key)
            else:
                await self._wait(stopping)
                # Woken: the consumer claims at once while the lock is released (one round trip
                # less on the wake-up path); the next sleep waits for the release first.
                self._unlocking = asyncio.ensure_future(
                    listener.execute("SELECT pg_advisory_unlock($1)", self.lock_key)
                )
        except DB_ERRORS as exc:
            self._lost(exc)
            await self._drop()  # closing the session releases the lock
            return
        if work and not self._kicked():
            # Work we could not claim is held by another consumer: back off a little, not spin.
            self._busy_rechecks += 1
            if self._busy_rechecks > 1:
                await wait_any(stopping, min(0.001 * self._busy_rechecks, 0.02))

    async def _sleep_beside(
        self, listener: asyncpg.Connection, stopping: asyncio.Event, *, sleeper: bool
    ) -> None:
        """The lock was not free. If a sleeping consumer holds it, writers notify, and this
        listening connection gets the notifications too: look once more, then sleep without the
        lock. If only writers hold it (shared), wait LOCK_WAIT_MS or for a kick, and return: the
        consumer looks for work and the next sleep tries the lock again."""
        if not sleeper:
            self._table_hint = True
            await wait_any(stopping, LOCK_WAIT_MS / 1000, self._wake)
            return
        try:
            if self._found(await listener.fetchval(self.has_work_sql)):
                return
        except DB_ERRORS as exc:
            self._lost(exc)
            await self._drop()
            return
        await self._wait(stopping)

    async def _wait(self, stopping: asyncio.Event) -> None:
        self.waits += 1
        await wait_any(stopping, self.poll_s, self._wake)
        self._wake.clear()  # the consumer looks for work now: kicks from here on count

    def _found(self, has_work: object) -> bool:
        if has_work:
            self._table_hint = True
        return bool(has_work)

    def _kicked(self) -> bool:
        """A kick (or a notification) came since the last sleep ended: clear it, look now."""
        if not self._wake.is_set():
            return False
        self._wake.clear()
        return True

    async def close(self) -> None:
        await self._drop()

    def _lost(self, exc: BaseException) -> None:
        self._table_hint = True
        log(logger, logging.WARNING, f"{self.name} listener lost", error=repr(exc))

    async def _connect(self) -> asyncpg.Connection | None:
        if self._listener is not None and not self._listener.is_closed():
            return self._listener
        self._listener = None
        try:
            conn = await self.db.session()
        except DB_ERRORS as exc:
            log(logger, logging.WARNING, f"{self.name} listener cannot connect", error=repr(exc))
            return None
        try:
            await conn.add_listener(self.channel, self._on_notify)
        except DB_ERRORS as exc:
            log(logger, logging.WARNING, f"{self.name} listener setup failed", error=repr(exc))
            conn.terminate()
            return None
        self._listener = conn
        return conn

    def _on_notify(self, *_: object) -> None:
        self._table_hint = True
        self._wake.set()

    async def _drop(self) -> None:
        if self._unlocking is not None:
            unlocking, self._unlocking = self._unlocking, None
            await asyncio.gather(unlocking, return_exceptions=True)
        conn, self._listener = self._listener, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), timeout=2.0)
            except DB_ERRORS:
                conn.terminate()
