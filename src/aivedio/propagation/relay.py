"""The outbox relay: publish ``outbox_events`` rows to the bus at least once, in per-task order.

One round (``pump``) is one transaction: claim a batch (``outbox_claim``: due pending rows, oldest
first, ``FOR UPDATE SKIP LOCKED``, only the oldest pending row of each task), publish it with
``Bus.publish_many`` (many in flight; key = task id, dedup id = outbox id, so a republished row is
dropped by the broker's ``Nats-Msg-Id`` window), then mark the acked rows published and the failed
ones for a retry with backoff (one UPDATE each), and commit: the published mark and the COMMIT
in one round trip. A relay that dies anywhere before the commit leaves the rows pending and
locked only until its connection goes away; the next round republishes them and the broker
answers ``duplicate``.

Order: a task's next row is not claimable while an older one is pending, whoever holds it, so one
task never has two events in flight, across any number of relays (``docs/explanation/
propagation.md`` has the argument). The price: a task with k pending events needs k rounds.

Waking: after an empty round the relay sleeps in :class:`aivedio.db.wakeup.IdleListener` on
``LISTEN aivedio_outbox`` holding advisory lock :data:`IDLE_LOCK`; the insert trigger notifies
only while that lock is held (see migration 0003), and the relay re-checks for work once it holds
the lock; a commit of the inbox processor of its process kicks it in memory instead, and sends
no NOTIFY (migration 0018). A busy relay naps for that kick between rounds. A poll every
``poll_interval_s`` is the safety net (lost connection, rows whose retry became due).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import asyncpg
from prometheus_client import Counter, Gauge, Histogram

from aivedio.bus import Bus, BusError, BusUnavailable, OutgoingMessage, PublishAck
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.db.wakeup import DB_ERRORS, IdleListener, wait_any
from aivedio.logs import log
from aivedio.process import health

__all__ = [
    "IDLE_LOCK",
    "NOTIFY_CHANNEL",
    "OutboxRelay",
    "PumpResult",
    "RelayConfig",
    "stamped",
]

logger = logging.getLogger("aivedio.relay")

NOTIFY_CHANNEL = "aivedio_outbox"
IDLE_LOCK = 0x4F555442  # "OUTB"; the same number is in migration 0003's trigger
VACUUM_LOCK = 0x4F555456  # "OUTV": one relay vacuums at a time

BACKLOG = Gauge("aivedio_outbox_backlog", "Outbox rows waiting to be published (pending)")
OLDEST_AGE = Gauge(
    "aivedio_outbox_oldest_pending_age_seconds", "Age of the oldest pending outbox row"
)
PUBLISH_SECONDS = Histogram(
    "aivedio_outbox_publish_seconds",
    "Time to publish one claimed batch until every broker ack (or failure) arrived",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RELAY_LAG = Histogram(
    "aivedio_outbox_relay_lag_seconds",
    "From the outbox insert to the broker's ack, per published event",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0, 120.0),
)
PUBLISHED = Counter(
    "aivedio_outbox_published_total",
    "Outbox rows marked published, by whether the broker already had them",
    ["duplicate"],
)
FAILED = Counter(
    "aivedio_outbox_publish_failures_total",
    "Outbox publishes that failed and will be retried (unavailable) or were rejected",
    ["kind"],
)
DEAD = Counter(
    "aivedio_outbox_dead_total", "Outbox rows given up on after repeated broker rejections"
)


# Called after the broker acked a batch and before the rows are marked: tests inject a crash here.
AfterPublish = Callable[[Sequence[asyncpg.Record]], Awaitable[None]]


def dedup_id(event_type: str, aggregate_id: object, aggregate_version: int) -> str:
    """The broker's dedup id of one outbox row: its business key, not the row id.

    Row ids are only unique within one database: a restored or re-created database (or two test
    databases sharing a broker) hands out the same ids again, and the broker would drop those
    events as duplicates for the whole duplicate window. (task, version, type) is unique for
    good and the same for every retry of the row.
    """
    return f"{event_type}:{aggregate_id}:{aggregate_version}"


def stamped(payload: str, suffix: str) -> bytes:
    """The bus message of an outbox payload (a JSON object as text): the same object with
    ``stored_at`` (the row's insert, DB clock) and ``relayed_at`` (the Unix time of this round's
    publish) appended (``suffix`` is ``,"stored_at":<time>,"relayed_at":<time>}``). The
    dispatcher carries them on to the gateways, so that the dispatcher's lag and the event's
    age at the socket are measured (``aivedio_dispatch_lag_seconds``,
    ``aivedio_gateway_event_age_seconds``) and ``aivedio bench e2e`` can tell where the time
    goes; nothing public, and the row keeps its payload. Text that is not an object (never
    written by the state service) goes as it is. Two string operations, not a decode and an
    encode; a bus header would cost every dispatcher a header parse per delivery (~3 us)."""
    if payload.endswith("}") and payload.startswith("{") and payload != "{}":
        return (payload[:-1] + suffix).encode()
    return payload.encode()


_IDS = "$1::bigint[]"


def mark_published_and_commit(ids: Sequence[int]) -> str:
    """``outbox_mark_published`` of ``ids`` and the round's ``COMMIT`` as ONE simple query: one
    round trip instead of two per round (a parameter needs the extended protocol, which takes
    one statement). The ids are the claim's own bigints, written as an array literal; in a
    transaction block an error in the UPDATE skips the COMMIT, and ``pump`` rolls back.
    ``pg_stat_statements`` still names the UPDATE ``outbox_mark_published`` (the literal
    normalizes to ``$1``)."""
    if not ids:
        return "COMMIT"
    sql = q("outbox_mark_published")
    if sql.count(_IDS) != 1:  # the query file changed shape: say so, never send a bare $1
        raise RuntimeError(f"outbox_mark_published must take its ids as {_IDS} exactly once")
    array = "'{" + ",".join(str(int(i)) for i in ids) + "}'::bigint[]"
    return sql.replace(_IDS, array) + ";\nCOMMIT"


@dataclass(frozen=True, slots=True)
class RelayConfig:
    batch_size: int = 1000
    poll_interval_s: float = 1.0  # safety net: claim at least this often when idle
    retry_base_s: float = 0.5  # first retry delay of a failed row; doubles per failure
    retry_max_s: float = 10.0
    max_rejections: int = 10  # broker rejections (not outages) before a row becomes 'dead'
    broker_pause_s: float = 0.5  # after a batch the broker could not take at all
    # VACUUM (ANALYZE) the outbox once a backlog of at least this many rows has been published
    # by this relay and drained (0: never; autovacuum only). See ``_vacuum``.
    vacuum_after_rows: int = 10_000
    stats_interval_s: float = 5.0  # backlog gauges
    kick_wait_s: float = 0.02
    """After a round that took all it found, how long the relay waits for a kick (its process's
    next commit) before it falls asleep with the statements that takes (``IdleListener``). Rows
    of writers that do not kick wait at most this long for the re-check, unless a round takes
    them first (a round claims every due row, whoever wrote it)."""
    # The outbox row's event_type -> bus topic: progress-only versions (state.events) go to a
    # topic of their own, which only the dispatcher reads (propagation.dispatcher).
    topics: Mapping[str, str] = field(
        default_factory=lambda: {
            "task.status.changed": "task.status",
            "task.progress.changed": "task.progress",
        }
    )

    def topic(self, event_type: str) -> str:
        return self.topics.get(event_type, event_type)


@dataclass(frozen=True, slots=True)
class PumpResult:
    claimed: int = 0
    published: int = 0
    unavailable: int = 0  # failed because the broker was unavailable (retried, never dead)
    rejected: int = 0  # failed because the broker refused the message

    @property
    def broker_down(self) -> bool:
        return self.claimed > 0 and self.unavailable == self.claimed


class OutboxRelay:
    """One relay replica. ``run(stopping)`` until ``stopping`` is set; ``pump()`` for one round."""

    def __init__(
        self,
        db: Database,
        bus: Bus,
        config: RelayConfig | None = None,
        *,
        after_publish: AfterPublish | None = None,
    ) -> None:
        self.db = db
        self.bus = bus
        self.config = config or RelayConfig()
        self._after_publish = after_publish
        self.idle = IdleListener(
            db,
            channel=NOTIFY_CHANNEL,
            lock_key=IDLE_LOCK,
            has_work_sql=q("outbox_has_work"),
            poll_s=self.config.poll_interval_s,
            name="outbox",
        )
        """The relay's sleep; ``idle.kick()`` wakes it after a commit in this process."""
        self._since_vacuum = 0  # rows this relay published since its last vacuum
        self._vacuuming: asyncio.Task[None] | None = None

    # -- one round ---------------------------------------------------------------------------

    async def pump(self) -> PumpResult:
        """Claim, publish, mark: one transaction. Returns what happened to the batch.

        The transaction commits without waiting for its WAL flush (``synchronous_commit = off``,
        set in the same round trip as ``BEGIN``): a mark lost in a crash only means the rows are
        published again, which the broker's dedup window and the consumers' keys absorb. The
        relay's next round does not wait for a disk flush, nor does the event behind it.
        """
        async with self.db.connection() as conn:
            await conn.execute("BEGIN; SET LOCAL synchronous_commit = off")
            try:
                result, ok = await self._round(conn)
            except BaseException:
                # The pool resets (or drops) a connection it gets back in a transaction anyway.
                with contextlib.suppress(*DB_ERRORS, OSError):
                    if not conn.is_closed():
                        await conn.execute("ROLLBACK")
                raise
        self._count(ok, result)
        return result

    async def _round(
        self, conn: asyncpg.Connection
    ) -> tuple[PumpResult, list[tuple[asyncpg.Record, PublishAck]]]:
        """The body of ``pump``'s transaction, which ``pump`` opened: claim, publish, mark,
        and the COMMIT (sent with the mark: ``mark_published_and_commit``)."""
        cfg = self.config
        rows = await conn.fetch(q("outbox_claim"), cfg.batch_size)
        if not rows:
            await conn.execute("COMMIT")
            return PumpResult(), []
        messages = []
        relayed = f',"relayed_at":{time.time():.6f}}}'  # one stamp per round
        for r in rows:
            event_type, task = r["event_type"], str(r["aggregate_id"])
            suffix = f',"stored_at":{r["created_at"].timestamp():.6f}{relayed}'
            messages.append(
                OutgoingMessage(
                    topic=cfg.topic(event_type),
                    key=task,
                    dedup_id=dedup_id(event_type, task, r["aggregate_version"]),
                    payload=stamped(r["payload"], suffix),
                )
            )
        started = time.perf_counter()
        results = await self.bus.publish_many(messages)
        PUBLISH_SECONDS.observe(time.perf_counter() - started)
        if self._after_publish is not None:
            await self._after_publish(rows)
        result, ok, failed = self._sort(rows, results)
        if failed:
            ids, delays, dead = zip(*failed, strict=True)
            await conn.execute(q("outbox_mark_failed"), list(ids), list(delays), list(dead))
        await conn.execute(mark_published_and_commit([r["id"] for r, _ in ok]))
        return result, ok

    def _sort(
        self,
        rows: Sequence[asyncpg.Record],
        results: Sequence[PublishAck | BusError | ValueError],
    ) -> tuple[PumpResult, list[tuple[asyncpg.Record, PublishAck]], list[tuple[int, float, bool]]]:
        cfg = self.config
        ok: list[tuple[asyncpg.Record, PublishAck]] = []
        failed: list[tuple[int, float, bool]] = []
        unavailable = rejected = 0
        for row, res in zip(rows, results, strict=True):
            if isinstance(res, PublishAck):
                ok.append((row, res))
                continue
            tries = row["retry_count"]
            delay = min(cfg.retry_max_s, cfg.retry_base_s * 2 ** min(tries, 20))
            delay *= random.uniform(0.8, 1.2)
            if isinstance(res, BusUnavailable):
                unavailable += 1
                failed.append((row["id"], delay, False))
                continue
            rejected += 1
            dead = tries + 1 >= cfg.max_rejections
            failed.append((row["id"], delay, dead))
            log(
                logger,
                logging.ERROR if dead else logging.WARNING,
                "outbox row rejected by the broker",
                outbox_id=row["id"],
                task_id=str(row["aggregate_id"]),
                task_version=row["aggregate_version"],
                trace_id=row["trace_id"],
                tries=tries + 1,
                dead=dead,
                error=str(res),
            )
        result = PumpResult(len(rows), len(ok), unavailable, rejected)
        return result, ok, failed

    @staticmethod
    def _count(ok: list[tuple[asyncpg.Record, PublishAck]], result: PumpResult) -> None:
        now = time.time()
        duplicates = 0
        for row, ack in ok:
            duplicates += ack.duplicate
            RELAY_LAG.observe(max(0.0, now - row["created_at"].timestamp()))
        if len(ok) - duplicates:
            PUBLISHED.labels("false").inc(len(ok) - duplicates)
        if duplicates:
            PUBLISHED.labels("true").inc(duplicates)
        if result.unavailable:
            FAILED.labels("unavailable").inc(result.unavailable)
        if result.rejected:
            FAILED.labels("rejected").inc(result.rejected)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Pump until ``stopping``: again at once after a full round; after a round that took
        all it found, nap for a kick (``kick_wait_s``); after an empty one, or a nap that no
        kick ended, sleep until a writer's NOTIFY (or a kick) wakes it (``IdleListener``).

        There was a busy poll here (``outbox_has_work`` every 2 ms for 50 ms after a publish),
        from when falling asleep waited for the slowest writer in flight. Since that wait is
        bounded, the poll only cost CPU (at 20 events/s the relay's fell from ~5.1 to ~1.4 ms
        per event without it) and time (its 2 ms step against a NOTIFY's wake-up):
        ``bench e2e`` figures in ``docs/reference/benchmarks.md``.
        """
        cfg = self.config
        stats = asyncio.create_task(self._stats_loop(stopping))
        failures = 0
        try:
            while not stopping.is_set():
                try:
                    result = await self.pump()
                    failures = 0
                except DB_ERRORS as exc:
                    failures += 1
                    log(logger, logging.WARNING, "outbox relay round failed", error=repr(exc))
                    health.outage("database", exc)
                    await wait_any(stopping, min(cfg.poll_interval_s, 0.1 * 2**failures))
                    continue
                if result.broker_down:
                    health.outage("bus", "BusUnavailable")
                elif result.published:
                    health.recovered()
                else:  # the database answered; nothing was published, so the bus is unknown
                    health.recovered("database")
                self._since_vacuum += result.published
                if result.claimed < cfg.batch_size:
                    self._maybe_vacuum()
                if result.claimed:
                    self.idle.worked()
                    if result.broker_down:
                        await wait_any(stopping, cfg.broker_pause_s)
                    if result.claimed == cfg.batch_size or result.broker_down:
                        continue  # more is likely there: claim again at once
                    if await self.idle.nap(stopping, cfg.kick_wait_s):
                        continue
                await self.idle.sleep(stopping)
        finally:
            stats.cancel()
            if self._vacuuming is not None:
                self._vacuuming.cancel()
            await asyncio.gather(stats, *filter(None, [self._vacuuming]), return_exceptions=True)
            await self.idle.close()

    def _maybe_vacuum(self) -> None:
        cfg = self.config
        if (
            cfg.vacuum_after_rows > 0
            and self._since_vacuum >= cfg.vacuum_after_rows
            and (self._vacuuming is None or self._vacuuming.done())
        ):
            self._since_vacuum = 0
            self._vacuuming = asyncio.create_task(self._vacuum())

    async def _vacuum(self) -> None:
        """VACUUM (ANALYZE) the outbox after a drained backlog, in the background.

        Marking rows published leaves their entries in the partial indexes on pending rows until
        a vacuum, and they sit at the low ids where every claim and ``outbox_has_work`` starts
        scanning: after 50,000 rows, each claim cost ~2-3 ms instead of ~0.1 ms (and planned
        for 50,000 pending rows) until autovacuum came by, up to a minute later; the bench's
        one-at-a-time events took p50 22 ms instead of 5 ms. VACUUM takes a lock that lets
        writers and other relays go on; one relay at a time (an advisory lock), and a relay that
        may not vacuum (not the table's owner) logs it and carries on.
        """
        try:
            async with self.db.connection() as conn:
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", VACUUM_LOCK):
                    return
                try:
                    started = time.perf_counter()
                    await conn.execute("VACUUM (ANALYZE) outbox_events")
                    log(
                        logger,
                        logging.INFO,
                        "outbox vacuumed after a drained backlog",
                        seconds=round(time.perf_counter() - started, 3),
                    )
                finally:
                    await conn.execute("SELECT pg_advisory_unlock($1)", VACUUM_LOCK)
        except DB_ERRORS as exc:
            log(logger, logging.WARNING, "outbox vacuum failed", error=repr(exc))

    async def _stats_loop(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.update_gauges()
            except DB_ERRORS as exc:
                log(logger, logging.DEBUG, "outbox stats failed", error=repr(exc))
            await wait_any(stopping, self.config.stats_interval_s)

    async def update_gauges(self) -> tuple[int, float]:
        """Refresh the backlog gauges; returns (pending rows, age of the oldest in seconds)."""
        async with self.db.connection() as conn:
            row = await conn.fetchrow(q("outbox_stats"))
        assert row is not None
        BACKLOG.set(row["backlog"])
        OLDEST_AGE.set(row["oldest_age_s"])
        return int(row["backlog"]), float(row["oldest_age_s"])
