"""The reconciler role: finds what the event-driven paths missed, and never regenerates.

Each round runs these sweeps; every one claims its rows so that any number of replicas share the
work without doing any of it twice at once:

overdue in-flight attempts
    a provider-active task whose state has not changed for longer than the provider/model's
    expected maximum duration is queried (``adapter.query``) and the answer applied with
    ``source = reconcile`` through the state service, like any poll. A provider that no longer
    knows the job (404 long after submit) opens a ``provider_not_found`` item for an operator.
unknown submits
    ``lookup(client_request_id)`` where the adapter supports it: found -> the provider id is
    recorded and ``SUBMIT_ACCEPTED`` applied (the poller takes over); not found (or no lookup)
    for longer than ``lookup_grace_s`` -> a ``submit_unknown`` item for an operator, who may
    ``aivedio tasks resubmit``.
poll items overtaken by the facts
    ``poll_not_found`` / ``poll_malformed`` items the poller opened are resolved by the reconciler
    once the attempt answered a poll well again (``recovered``), or once it is no longer the
    task's current attempt or the task finished (``attempt_finished``); the rest stay open.
stuck inbox rows
    pending / retry rows long past their due time and not leased -> due now again, or dead
    once they used up the processor's tries.
inbox retention
    processed payloads older than the retention are nulled (``expire_processed_payloads``).
session retention
    browser sessions expired or revoked longer ago than ``sessions_retention_s`` are deleted.

Contradictory terminals and stale-attempt successes are opened by the state service itself
(``reconciliation_items``); they are listed and resolved with ``aivedio reconcile``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
from prometheus_client import Counter

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.statuses import STATUS_TABLE
from aivedio.ingest.inbox_batch import expire_processed_payloads
from aivedio.logs import log, trace_id_var
from aivedio.process.rounds import run_rounds
from aivedio.providers.port import NotFoundYet, ProviderAdapter, ProviderError, Unsupported
from aivedio.reconcile.config import ReconcilerConfig
from aivedio.state.service import StateService

logger = logging.getLogger("aivedio.reconciler")

RECONCILED = Counter(
    "aivedio_reconciler_actions_total",
    "Reconciler actions, by sweep and outcome",
    ["sweep", "outcome"],
)

# Statuses in which the provider still owns the outcome and we already know its job id.
_OVERDUE_STATUSES: list[str] = sorted(
    str(s.status) for s in STATUS_TABLE.values() if s.provider_active
)

_TERMINAL_STATUSES: list[str] = sorted(str(s.status) for s in STATUS_TABLE.values() if s.terminal)


@dataclass(frozen=True, slots=True)
class RoundResult:
    overdue_queried: int = 0
    lookups: int = 0
    inbox_requeued: int = 0
    inbox_dead: int = 0
    payloads_expired: int = 0
    poll_items_resolved: int = 0
    sessions_purged: int = 0

    @property
    def total(self) -> int:
        return (
            self.overdue_queried
            + self.lookups
            + self.inbox_requeued
            + self.inbox_dead
            + self.payloads_expired
            + self.poll_items_resolved
            + self.sessions_purged
        )


class Reconciler:
    def __init__(
        self,
        db: Database,
        state: StateService,
        adapters: Mapping[str, ProviderAdapter],
        config: ReconcilerConfig | None = None,
    ) -> None:
        self.db = db
        self.state = state
        self.adapters = adapters
        self.config = config or ReconcilerConfig()

    async def run(self, stopping: asyncio.Event) -> None:
        # Replicas started together should not sweep in lockstep.
        await asyncio.sleep(random.uniform(0, min(self.config.interval_s, 5.0)))

        async def one_round() -> int:
            await self.run_once()
            return 0  # always pause: a sweep is periodic, never a busy loop

        await run_rounds(stopping, one_round, self.config.interval_s, logger, "reconciler")

    async def run_once(self) -> RoundResult:
        overdue = await self.sweep_overdue()
        lookups = await self.sweep_unknown_submits()
        poll_items = await self.sweep_poll_items()
        requeued, dead = await self.sweep_stuck_inbox()
        expired = await expire_processed_payloads(
            self.db, timedelta(seconds=self.config.inbox_retention_s)
        )
        if expired:
            RECONCILED.labels("inbox_retention", "expired").inc(expired)
        purged = await self.purge_sessions()
        return RoundResult(overdue, lookups, requeued, dead, expired, poll_items, purged)

    async def purge_sessions(self) -> int:
        async with self.db.connection() as conn:
            status = await conn.execute(
                q("purge_browser_sessions"),
                timedelta(seconds=self.config.sessions_retention_s),
                self.config.batch_size * 10,
            )
        purged = int(status.split()[-1])
        if purged:
            RECONCILED.labels("session_retention", "deleted").inc(purged)
        return purged

    # -- overdue in-flight attempts ---------------------------------------------------------

    async def sweep_overdue(self) -> int:
        cfg = self.config
        keys = list(cfg.max_durations)
        async with self.db.connection() as conn:
            claimed = await conn.fetch(
                q("claim_overdue_attempts"),
                _OVERDUE_STATUSES,
                cfg.expected_max_duration_s,
                keys,
                [float(cfg.max_durations[k]) for k in keys],
                timedelta(seconds=cfg.check_interval_s),
                cfg.batch_size,
            )
            if not claimed:
                return 0
            rows = await conn.fetch(q("attempts_to_query"), [r["attempt_id"] for r in claimed])
        await asyncio.gather(
            *(
                self._query_overdue(
                    r["attempt_id"], r["provider"], r["provider_task_id"], r["trace_id"]
                )
                for r in rows
            )
        )
        return len(rows)

    async def _query_overdue(
        self, attempt_id: uuid.UUID, provider: str, provider_task_id: str, trace_id: str | None
    ) -> None:
        adapter = self.adapters.get(provider)
        if adapter is None:
            await self._check_result(attempt_id, "no_adapter")
            return
        token = trace_id_var.set(trace_id)
        try:
            job = await adapter.query(provider_task_id)
        except NotFoundYet:
            RECONCILED.labels("overdue", "not_found").inc()
            await self._open_item(
                "provider_not_found",
                attempt_id,
                {"provider": provider, "provider_task_id": provider_task_id},
            )
            await self._check_result(attempt_id, "not_found")
            return
        except ProviderError as exc:
            RECONCILED.labels("overdue", "query_failed").inc()
            await self._check_result(attempt_id, type(exc).__name__)
            return
        finally:
            trace_id_var.reset(token)
        result = await self.state.apply(
            job.observation(provider, attempt_id, Source.RECONCILE, trace_id=trace_id)
        )
        outcome = str(result.outcome) if result.reason is None else str(result.reason)
        RECONCILED.labels("overdue", outcome).inc()
        await self._check_result(attempt_id, f"{job.status}:{outcome}")
        if result.event is not None:
            log(
                logger,
                logging.INFO,
                "overdue attempt reconciled",
                attempt_id=str(attempt_id),
                provider_status=str(job.status),
            )

    async def _check_result(self, attempt_id: uuid.UUID, result: str) -> None:
        async with self.db.connection() as conn:
            await conn.execute(q("record_check_result"), attempt_id, result)

    # -- unknown submits --------------------------------------------------------------------

    async def sweep_unknown_submits(self) -> int:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(
                q("claim_unknown_submits"),
                timedelta(seconds=self.config.lookup_interval_s),
                self.config.batch_size,
            )
        await asyncio.gather(*(self._lookup(r) for r in rows))
        return len(rows)

    async def _lookup(self, row: asyncpg.Record) -> None:
        attempt_id = row["attempt_id"]
        provider = str(row["provider"])
        client_request_id = str(row["client_request_id"])
        trace_id = row["trace_id"] if isinstance(row["trace_id"], str) else None
        assert isinstance(attempt_id, uuid.UUID)
        adapter = self.adapters.get(provider)
        found: str | None = None
        reason = "not_found"
        if adapter is None:
            reason = "no_adapter"
        elif not adapter.supports_lookup:
            reason = "lookup_unsupported"
        else:
            try:
                found = await adapter.lookup(client_request_id)
            except Unsupported:
                reason = "lookup_unsupported"
            except ProviderError as exc:
                RECONCILED.labels("unknown_submit", "lookup_failed").inc()
                log(
                    logger,
                    logging.INFO,
                    "lookup failed",
                    attempt_id=str(attempt_id),
                    error=str(exc),
                )
                return
        if found is not None:
            await self._found(attempt_id, found, trace_id)
            RECONCILED.labels("unknown_submit", "found").inc()
            return
        unknown_at = row["unknown_at"]
        waited = (
            datetime.now(UTC) - unknown_at if isinstance(unknown_at, datetime) else timedelta.max
        )
        if waited >= timedelta(seconds=self.config.lookup_grace_s):
            opened = await self._open_item(
                "submit_unknown",
                attempt_id,
                {
                    "provider": provider,
                    "client_request_id": client_request_id,
                    "lookups": row["lookups"],
                    "reason": reason,
                },
            )
            if opened:
                RECONCILED.labels("unknown_submit", "item_opened").inc()
                log(
                    logger,
                    logging.WARNING,
                    "unknown submit needs an operator",
                    attempt_id=str(attempt_id),
                    reason=reason,
                    alert=True,
                )
        else:
            RECONCILED.labels("unknown_submit", reason).inc()

    async def _found(
        self, attempt_id: uuid.UUID, provider_task_id: str, trace_id: str | None
    ) -> None:
        first_poll = timedelta(seconds=random.uniform(2.0, 5.0))
        async with self.db.transaction() as conn:
            if await conn.fetchval(q("submit_intent_found"), attempt_id) is None:
                return  # resolved meanwhile
            await conn.fetchval(
                q("record_provider_task_id"), attempt_id, provider_task_id, first_poll
            )
            await self.state.apply_in(
                conn,
                PlatformObservation(
                    kind=PlatformKind.SUBMIT_ACCEPTED,
                    attempt_id=attempt_id,
                    source=Source.RECONCILE,
                    trace_id=trace_id,
                ),
            )
            await conn.execute(
                q("resolve_items_of_attempt"), attempt_id, "found_by_lookup", "reconciler"
            )
        log(logger, logging.INFO, "unknown submit found by lookup", attempt_id=str(attempt_id))

    # -- poll items -------------------------------------------------------------------------

    async def sweep_poll_items(self) -> int:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(
                q("resolve_recovered_poll_items"), _TERMINAL_STATUSES, self.config.batch_size
            )
        for row in rows:
            RECONCILED.labels("poll_items", str(row["resolution"])).inc()
            log(
                logger,
                logging.INFO,
                "poll item resolved",
                item_id=row["id"],
                kind=row["kind"],
                attempt_id=str(row["attempt_id"]),
                resolution=row["resolution"],
            )
        return len(rows)

    # -- inbox ------------------------------------------------------------------------------

    async def sweep_stuck_inbox(self) -> tuple[int, int]:
        async with self.db.transaction() as conn:
            rows = await conn.fetch(
                q("requeue_stuck_inbox"),
                timedelta(seconds=self.config.inbox_stuck_s),
                self.config.inbox_max_tries,
                self.config.batch_size,
            )
        dead = sum(1 for r in rows if r["process_status"] == "dead")
        requeued = len(rows) - dead
        if requeued:
            RECONCILED.labels("inbox", "requeued").inc(requeued)
        if dead:
            RECONCILED.labels("inbox", "dead").inc(dead)
            log(logger, logging.WARNING, "stuck inbox rows dead-lettered", rows=dead, alert=True)
        return requeued, dead

    # -- items ------------------------------------------------------------------------------

    async def _open_item(self, kind: str, attempt_id: uuid.UUID, detail: dict[str, object]) -> bool:
        async with self.db.connection() as conn:
            return await conn.fetchval(q("open_item"), kind, attempt_id, detail) is not None
