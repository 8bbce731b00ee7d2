"""The inbox processor: stored callbacks -> provider observations -> the state service.

Claim with a lease
    One short statement claims up to ``batch_size`` due rows (``pending`` / ``retry`` /
    ``orphan`` with ``next_retry_at`` passed) with ``FOR UPDATE SKIP LOCKED`` and stamps them with
    ``lease_until`` and this claim's ``lease_token``; it commits at once. Any number of
    processors run side by side: SKIP LOCKED gives them disjoint rows, and the lease keeps a
    claimed row away from the others while it is worked on (a crashed processor's rows become
    due again when the lease passes; rows the database interrupted, as soon as it is back:
    :mod:`aivedio.db.leases`).
Handed over, no claim
    In a process that also runs the callbacks role, the group commit stores new callbacks
    already leased to this processor and hands them over in memory (:mod:`aivedio.db.handoff`):
    they skip the claim's statement and its row update. The processor claims from the table
    only when it may hold rows: this process stored some there (it was behind), the last claim
    found rows (handed and claimed batches then alternate), the sleep saw signs of others'
    (:meth:`~aivedio.db.wakeup.IdleListener.table_hint`: retries, orphans, other processes'
    rows), or ``poll_s`` passed since an empty claim. It gives back the leases of rows it
    never took when it stops.
One transaction per claim
    Each row is first prepared outside any transaction: normalized, mapped to its attempt (and
    the attempt's project: one statement for the whole claim, ``attempts_for_callbacks``),
    re-fetched for unsigned providers (no HTTP call ever runs inside a transaction). A row that
    cannot be applied now is deferred alone. The ready rows are then applied in ONE transaction,
    whatever their projects: lock them again *fenced by the token* and mark them processed in
    the same statement (a row whose lease another processor took over is left out, and nothing
    of it is written), ``StateService.apply_many_in`` in inbox id order (each observation
    decided as ``apply`` would, against the task as the rows before it left it; tasks locked in
    task id order, then the stream rows in project id order, as every writer takes them, so two
    processors cannot deadlock), record the provider task ids that callbacks taught, commit.
    If it fails for any reason but the database being away, it rolls back and its rows are
    applied one by one, each in its own transaction: a bad row goes to retry or dead letter
    alone and the others commit.
Mapping
    To the attempt by the callback token's attempt id (unsigned providers: the only
    authenticated id), else by ``(provider, provider_task_id)``, else by ``(provider,
    client_request_id)`` — a callback that came before the submit response; the attempt then
    gets its ``provider_task_id`` in the same transaction, is scheduled for polling, and its
    submit intent, if waiting for a retry, is accepted (the callback proves the provider took the
    submit, whose own response may never come).
Unsigned providers (``needs_refetch_on_callback``, ``payload_authenticated = false``), and terminals
    with ``confirm_terminals``: the body is only a hint: the processor queries the job by the id WE
    recorded for the attempt (the body's id only when we have none yet, and then the job must
    echo the attempt's client_request_id) and applies the provider's answer, with ``source =
    webhook`` (the callback caused it; ordered like any other: sequence, successor table).
Failures
    unmappable -> ``orphan`` with exponential backoff, ``dead`` after ``orphan_max_tries``;
    a payload the adapter cannot parse (or an unknown provider) -> ``retry`` with a redacted
    sample in ``last_error_sample``, ``dead`` after ``parse_max_tries``; a re-fetch that fails
    (429 / 5xx / 404 / timeout) -> ``retry``, ``dead`` after ``refetch_max_tries``. Dead letters
    are listed by :func:`~aivedio.ingest.retries.list_dead_letters` and requeued by
    :func:`~aivedio.ingest.retries.replay`. The steps' values are in
    :mod:`aivedio.ingest.prepare`, the backoff and the deferral counters in
    :mod:`aivedio.ingest.retries`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import Counter, Histogram

from aivedio.db.handoff import HandedRow, Handoff
from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.db.wakeup import IdleListener, Signal, wait_any
from aivedio.domain.observation import PROVIDER_TERMINAL, Source
from aivedio.errors import DatabaseUnavailable
from aivedio.ingest.prepare import (
    Attempts,
    Defer,
    InboxRecord,
    Normalized,
    Ready,
    fields_of,
    refetch,
    take_claimed,
)
from aivedio.ingest.retries import backoff_s, record_deferral
from aivedio.logs import log, trace_id_var
from aivedio.process import health
from aivedio.providers.port import PayloadError, ProviderAdapter
from aivedio.providers.redact import sample_of
from aivedio.state.service import ApplyResult, StateService

__all__ = ["IDLE_LOCK", "NOTIFY_CHANNEL", "InboxConfig", "InboxProcessor"]

logger = logging.getLogger("aivedio.ingest.processor")

NOTIFY_CHANNEL = "aivedio_inbox"
IDLE_LOCK = 0x494E4258  # "INBX"; the same number is in migration 0009's trigger

PROCESSED = Counter(
    "aivedio_inbox_processed_total",
    "Inbox rows applied through the state service, by outcome (applied / ignored / conflict)",
    ["provider", "outcome"],
)
PROCESS_SECONDS = Histogram(
    "aivedio_inbox_process_seconds",
    "Time to process one inbox row (normalize, map, re-fetch, apply)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
LAG_SECONDS = Histogram(
    "aivedio_inbox_lag_seconds",
    "From the gateway's receipt of a callback to its row being processed",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 300.0),
)


@dataclass(frozen=True, slots=True)
class InboxConfig:
    batch_size: int = 64
    """Most rows one claim takes."""
    concurrency: int = 8
    """Rows of one claim prepared (re-fetched from unsigned providers) at once."""
    lease_s: float = 60.0
    """How long a claimed row stays away from other processors."""
    poll_s: float = 0.5
    """After an empty claim the processor sleeps until a stored callback wakes it (an in-process
    kick, or NOTIFY: :class:`aivedio.db.wakeup.IdleListener`), or at most this long (rows whose
    retry became due, a lost listening connection)."""
    orphan_max_tries: int = 8
    orphan_backoff_base_s: float = 1.0
    orphan_backoff_cap_s: float = 300.0
    parse_max_tries: int = 3
    parse_backoff_base_s: float = 5.0
    confirm_terminals: bool = False
    """A signed callback saying the job ended is applied as the provider's record says (a query)."""
    refetch_max_tries: int = 10
    refetch_backoff_base_s: float = 2.0
    backoff_cap_s: float = 600.0
    error_backoff_s: float = 1.0
    """Pause of the loop after a database outage."""


class InboxProcessor:
    """Claims, maps and applies inbox rows. ``run`` is the role loop; ``process_once`` one claim."""

    def __init__(
        self,
        db: Database,
        state: StateService,
        adapters: Mapping[str, ProviderAdapter],
        config: InboxConfig | None = None,
        *,
        applied: Signal | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self.db = db
        self._handoff = handoff
        """Rows this process's group commit stored leased to this processor (module doc)."""
        self._claim_due = 0.0  # monotonic time of the next claim from the table while handed to
        self._applied = applied
        """Fired after a commit that wrote events: it wakes the outbox relay of this process.
        While a relay listens to it, the apply transactions say so to the outbox trigger, which
        then sends no NOTIFY to the other relays (``take_claimed``, migration 0018)."""
        self.state = state
        self.adapters = dict(adapters)
        self.config = config or InboxConfig()
        self.left = LeftLeases("inbox_end_leases")  # rows the database interrupted
        self.idle = IdleListener(
            db,
            channel=NOTIFY_CHANNEL,
            lock_key=IDLE_LOCK,
            has_work_sql=q("inbox_has_work"),
            poll_s=self.config.poll_s,
            name="inbox",
        )
        """The processor's sleep; ``idle.kick()`` wakes it (the group commit of its process
        calls it after storing callbacks)."""

    async def run(self, stopping: asyncio.Event) -> None:
        """Process until ``stopping`` is set: claim again at once after a claim that found rows,
        sleep until woken after an empty one. A database outage pauses, never ends, the loop."""
        if self._handoff is not None:
            self._handoff.attach(self.config.lease_s)
        try:
            while not stopping.is_set():
                try:
                    claimed = await self.process_once()
                except DatabaseUnavailable as exc:
                    log(logger, logging.WARNING, "inbox processor: database unavailable")
                    health.outage("database", exc)
                    await wait_any(stopping, self.config.error_backoff_s)
                    continue
                health.recovered()
                if claimed:
                    self.idle.worked()
                    continue
                await self.idle.sleep(stopping)
        finally:
            await self._give_back()
            await self.idle.close()

    async def _give_back(self) -> None:
        """Stopping: the leases of handed rows never taken end now, not when they run out."""
        if self._handoff is None:
            return
        token, rows = self._handoff.detach()
        if token is None or not rows:
            return
        with contextlib.suppress(DatabaseUnavailable):  # then they run out
            async with self.db.connection() as conn:
                await conn.execute(q("inbox_release"), [row["id"] for row in rows], token)

    async def process_once(self) -> int:
        """Process the handed rows, then claim a batch if the table is wanted; how many rows."""
        await self.left.give_back(self.db)
        handoff = self._handoff
        handed: list[HandedRow] = []
        if handoff is not None and len(handoff):
            token, handed = handoff.take(self.config.batch_size)
            if token is not None and handed:
                await self._process_rows(handed, token)
        if handoff is not None and not self._table_wanted(handoff):
            return len(handed)
        claimed = await self._claim_once()
        self._claim_due = 0.0 if claimed else time.monotonic() + self.config.poll_s
        return len(handed) + claimed

    def _table_wanted(self, handoff: Handoff) -> bool:
        """Whether the table may hold rows (module doc: "Handed over, no claim")."""
        due = time.monotonic() >= self._claim_due
        return handoff.claim_wanted() | self.idle.table_hint() | due

    async def _claim_once(self) -> int:
        """Claim one batch from the table and process every row of it; how many were claimed."""
        token = uuid.uuid4()
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                q("inbox_claim"), self.config.batch_size, self.config.lease_s, token
            )
        if not rows:
            return 0
        await self._process_rows(rows, token)
        return len(rows)

    async def _process_rows(self, rows: Sequence[InboxRecord], token: uuid.UUID) -> None:
        """Normalize every row, map them all with one query, re-fetch where needed, then apply
        the ready ones in one transaction."""
        normalized = [n for n in [await self._normalize(row, token) for row in rows] if n]
        if not normalized:
            return
        try:
            attempts = await Attempts.read(self.db, normalized)
        except DatabaseUnavailable:
            self._left_for_later([item.row for item in normalized], token)
            return
        limit = asyncio.Semaphore(self.config.concurrency)

        async def prepare(item: Normalized) -> Ready | None:
            async with limit:
                return await self._prepare(item, attempts, token)

        prepared = await asyncio.gather(*(prepare(item) for item in normalized))
        ready = [r for r in prepared if r is not None]
        if ready:
            await self._apply_group(ready, token)

    # -- one row ---------------------------------------------------------------------------

    async def _process(self, row: InboxRecord, token: uuid.UUID) -> None:
        """One row on its own: prepare it, then apply it in a transaction of its own."""
        item = await self._normalize(row, token)
        if item is None:
            return
        try:
            attempts = await Attempts.read(self.db, [item])
        except DatabaseUnavailable:
            self._left_for_later([row], token)
            return
        ready = await self._prepare(item, attempts, token)
        if ready is not None:
            await self._apply_one(ready, token)

    async def _normalize(self, row: InboxRecord, token: uuid.UUID) -> Normalized | None:
        """The adapter's reading of a stored callback; None when the row was deferred."""
        started = time.perf_counter()
        provider = row["provider"]
        adapter = self.adapters.get(provider)
        trace = trace_id_var.set(row["trace_id"])
        try:
            if adapter is None:
                raise Defer("parse", "unknown_provider")
            fields = fields_of(row)
            payload = row["payload"]
            if not isinstance(payload, Mapping):
                raise Defer("parse", "no_payload")
            try:
                claimed = adapter.normalize(payload, fields)
            except PayloadError as exc:
                sample = exc.sample or sample_of(payload)
                raise Defer("parse", f"payload_{exc.code}", sample) from None
            return Normalized(row, adapter, fields, claimed, started)
        except Defer as defer:
            await self._defer(row, token, defer)
        except Exception as exc:  # a bug: retry, then dead letter
            self._failed(row, exc)
            await self._defer(row, token, Defer("parse", "internal_error"))
        finally:
            trace_id_var.reset(trace)
        PROCESS_SECONDS.observe(time.perf_counter() - started)
        return None

    async def _prepare(
        self, item: Normalized, attempts: Attempts, token: uuid.UUID
    ) -> Ready | None:
        """Map one normalized row and (for unsigned providers) re-fetch its job; None when the
        row was deferred (orphan / retry / dead) or left for later instead."""
        row = item.row
        trace = trace_id_var.set(row["trace_id"])
        try:
            return await self._ready(item, attempts)
        except Defer as defer:
            await self._defer(row, token, defer)
        except DatabaseUnavailable:
            self._left_for_later([row], token)
        except Exception as exc:  # a bug: retry, then dead letter
            self._failed(row, exc)
            await self._defer(row, token, Defer("parse", "internal_error"))
        finally:
            trace_id_var.reset(trace)
        PROCESS_SECONDS.observe(time.perf_counter() - item.started)
        return None

    async def _ready(self, item: Normalized, attempts: Attempts) -> Ready:
        row, adapter, fields, claimed = item.row, item.adapter, item.fields, item.claimed
        attempt = attempts.resolve(fields, claimed)
        state = claimed
        if (
            adapter.needs_refetch_on_callback
            or not fields.payload_authenticated
            or (self.config.confirm_terminals and claimed.status in PROVIDER_TERMINAL)
        ):
            state = await refetch(adapter, attempt, claimed)
        obs = state.observation(
            adapter.name,
            attempt.id,
            Source.WEBHOOK,
            provider_event_id=row["provider_event_id"],
            dedup_key=row["dedup_key"],
            received_at=row["received_at"],
            inbox_id=row["id"],
            trace_id=row["trace_id"],
        )
        return Ready(row, adapter, attempt, state, obs, item.started)

    # -- applying ------------------------------------------------------------------------------

    async def _apply_group(self, group: list[Ready], token: uuid.UUID) -> None:
        """A claim's prepared rows in one transaction, in inbox id order; see the module doc.
        A group of one is the one-row path."""
        if len(group) == 1:
            await self._apply_one(group[0], token)
            return
        group.sort(key=lambda ready: ready.row["id"])
        try:
            async with self.db.transaction() as conn:
                ours = {r["id"] for r in await take_claimed(conn, group, token, self._applied)}
                live = [ready for ready in group if ready.row["id"] in ours]
                observations = [ready.obs for ready in live]
                results = await self.state.apply_many_in(conn, observations, locked=True)
                taught = {ready.attempt.id: ready for ready in live if ready.teaches_task_id}
                if taught:
                    await conn.execute(
                        q("attempt_record_provider_task_ids"),
                        list(taught),
                        [ready.state.provider_task_id for ready in taught.values()],
                    )
        except DatabaseUnavailable:
            self._left_for_later([ready.row for ready in group], token)
            return
        except Exception as exc:  # one bad row must not hold back the others: one by one
            log(
                logger,
                logging.WARNING,
                "inbox batch failed; applying its rows one by one",
                rows=len(group),
                error=type(exc).__name__,
            )
            for ready in group:
                await self._apply_one(ready, token)
            return
        self._committed(results)
        for ready in group:
            if ready.row["id"] not in ours:
                log(logger, logging.INFO, "inbox row taken over", inbox_id=ready.row["id"])
        for ready, result in zip(live, results, strict=True):
            self._processed(ready, result)

    async def _apply_one(self, ready: Ready, token: uuid.UUID) -> None:
        """One prepared row in its own transaction; a failure defers it (retry, dead letter)."""
        row = ready.row
        trace = trace_id_var.set(row["trace_id"])
        try:
            async with self.db.transaction() as conn:
                if not await take_claimed(conn, [ready], token, self._applied):
                    log(logger, logging.INFO, "inbox row taken over", inbox_id=row["id"])
                    return
                result = await self.state.apply_in(conn, ready.obs, locked=True)
                if ready.teaches_task_id:
                    await conn.execute(
                        q("attempt_record_provider_task_ids"),
                        [ready.attempt.id],
                        [ready.state.provider_task_id],
                    )
            self._committed([result])
            self._processed(ready, result)
        except DatabaseUnavailable:
            self._left_for_later([row], token)
        except Exception as exc:  # a bug or a refused write: retry, then dead letter
            self._failed(row, exc)
            await self._defer(row, token, Defer("parse", "internal_error"))
        finally:
            trace_id_var.reset(trace)

    def _left_for_later(self, rows: Sequence[InboxRecord], token: uuid.UUID) -> None:
        """Rows the database kept from being processed: their leases end at the next round."""
        log(logger, logging.WARNING, "inbox rows left for later", rows=len(rows))
        for row in rows:
            self.left.add(row["id"], token)

    def _committed(self, results: list[ApplyResult]) -> None:
        if self._applied is not None and any(r.event is not None for r in results):
            self._applied.fire()

    def _processed(self, ready: Ready, result: ApplyResult) -> None:
        row = ready.row
        PROCESSED.labels(ready.adapter.name, str(result.outcome)).inc()
        PROCESS_SECONDS.observe(time.perf_counter() - ready.started)
        LAG_SECONDS.observe(max(0.0, (datetime.now(UTC) - row["received_at"]).total_seconds()))
        log(
            logger,
            logging.DEBUG,
            "inbox row processed",
            inbox_id=row["id"],
            provider=ready.adapter.name,
            outcome=str(result.outcome),
            reason=str(result.reason) if result.reason else None,
            task_id=str(result.task_id) if result.task_id else None,
            trace_id=row["trace_id"],
        )

    @staticmethod
    def _failed(row: InboxRecord, exc: Exception) -> None:
        log(
            logger,
            logging.ERROR,
            "inbox row failed",
            inbox_id=row["id"],
            provider=row["provider"],
            error=type(exc).__name__,
            trace_id=row["trace_id"],
        )

    async def _defer(self, row: InboxRecord, token: uuid.UUID, defer: Defer) -> None:
        """Put the row back for a later try (orphan / retry), or dead-letter it after its last."""
        status, max_tries, delay = self._retry_plan(defer, row["retry_count"] + 1)
        try:
            async with self.db.connection() as conn:
                result = await conn.fetchrow(
                    q("inbox_defer"),
                    row["id"],
                    token,
                    status,
                    max_tries,
                    delay,
                    defer.code,
                    defer.sample[:1000] if defer.sample else None,
                )
        except DatabaseUnavailable:
            self._left_for_later([row], token)
            return
        if result is None:
            return  # taken over by another processor
        record_deferral(row, defer, status, delay, result)

    def _retry_plan(self, defer: Defer, tries: int) -> tuple[str, int, float]:
        """The status a deferred row gets, its try budget and the delay before try ``tries``."""
        cfg = self.config
        if defer.kind == "orphan":
            status, max_tries = "orphan", cfg.orphan_max_tries
            delay = backoff_s(tries, cfg.orphan_backoff_base_s, cfg.orphan_backoff_cap_s)
        elif defer.kind == "refetch":
            status, max_tries = "retry", cfg.refetch_max_tries
            delay = backoff_s(tries, cfg.refetch_backoff_base_s, cfg.backoff_cap_s)
        else:
            status, max_tries = "retry", cfg.parse_max_tries
            delay = backoff_s(tries, cfg.parse_backoff_base_s, cfg.backoff_cap_s)
        if defer.min_delay_s is not None:
            delay = max(delay, defer.min_delay_s)
        return status, max_tries, delay
