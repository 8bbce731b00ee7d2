"""The cancel worker: turns a ``cancel_requested`` task into a provider cancel call.

The API writes a cancel intent in the transaction that moves the task to ``cancel_requested``
(``tasks.sql insert_cancel_intent``). A round claims due intents (``FOR UPDATE SKIP LOCKED`` and
a lease token, any number of replicas) and, per attempt:

- the task left ``cancel_requested`` (the provider finished first, or it was already canceled):
  nothing to do (``moot``);
- the attempt has a provider task id: ``adapter.cancel``; then one query, applied like a poll, so
  the confirmation usually lands at once (a webhook or the poller bring it otherwise). A provider
  that finished first answers "already terminal" and that terminal wins (the documented rule);
- no provider task id and the submit intent still ``pending`` (never sent) or ``rejected``: there
  is no job to cancel. The submit intent is taken back and ``CANCEL_CONFIRMED`` moves the task to
  ``canceled`` in the same transaction, so the submitter can never send it afterwards;
- the submit is in flight (``sending``) or its outcome is ``unknown``: wait; the submitter or the
  reconciler's lookup will record the provider id, and the cancel is sent then.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
from prometheus_client import Counter

from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.statuses import Status
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log, trace_id_var
from aivedio.process.rounds import backoff, run_rounds
from aivedio.providers.port import AuthFailed, ProviderAdapter, ProviderError, Rejected, Unsupported
from aivedio.state.service import StateService
from aivedio.submission.config import CancelConfig

logger = logging.getLogger("aivedio.cancel")

CANCELS = Counter(
    "aivedio_cancels_total",
    "Cancel intents handled, by provider and outcome (accepted, already_terminal, local, moot, "
    "waiting, retried, failed)",
    ["provider", "outcome"],
)


@dataclass(frozen=True, slots=True)
class CancelClaim:
    attempt_id: uuid.UUID
    task_id: uuid.UUID
    tries: int
    trace_id: str | None
    provider: str
    provider_task_id: str | None
    task_status: Status
    current: bool
    submit_state: str | None
    token: uuid.UUID

    @classmethod
    def of(cls, row: asyncpg.Record, token: uuid.UUID) -> CancelClaim:
        return cls(
            attempt_id=row["attempt_id"],
            task_id=row["task_id"],
            tries=row["tries"],
            trace_id=row["trace_id"],
            provider=row["provider"],
            provider_task_id=row["provider_task_id"],
            task_status=Status(row["status"]),
            current=row["current_attempt_id"] == row["attempt_id"],
            submit_state=row["submit_state"],
            token=token,
        )


class CancelWorker:
    """One replica of the cancel worker (run any number; usually beside the submitter)."""

    def __init__(
        self,
        db: Database,
        state: StateService,
        adapters: Mapping[str, ProviderAdapter],
        config: CancelConfig | None = None,
    ) -> None:
        self.db = db
        self.state = state
        self.adapters = adapters
        self.config = config or CancelConfig()
        self.left = LeftLeases("cancel_end_leases")  # cancels the database interrupted

    async def run(self, stopping: asyncio.Event) -> None:
        await run_rounds(stopping, self.run_once, self.config.idle_sleep_s, logger, "cancel")

    async def run_once(self) -> int:
        await self.left.give_back(self.db)
        token = uuid.uuid4()
        async with self.db.transaction() as conn:
            rows = await conn.fetch(
                q("claim_cancel_intents"),
                self.config.batch_size,
                timedelta(seconds=self.config.lease_s),
                token,
            )
        claims = [CancelClaim.of(row, token) for row in rows]
        await asyncio.gather(*(self._handle(c) for c in claims))
        return len(claims)

    async def _handle(self, c: CancelClaim) -> None:
        trace_token = trace_id_var.set(c.trace_id)
        try:
            try:
                await self._cancel(c)
            except DatabaseUnavailable:
                raise
            except Exception:
                logger.exception("cancel failed unexpectedly")
                CANCELS.labels(c.provider, "retried").inc()
                await self._retry(c, self._backoff(c), "internal_error")
        except DatabaseUnavailable:
            self.left.add(c.attempt_id, c.token)  # its lease ends once the database is back
            raise
        finally:
            trace_id_var.reset(trace_token)

    async def _cancel(self, c: CancelClaim) -> None:
        if c.task_status is not Status.CANCEL_REQUESTED or not c.current:
            CANCELS.labels(c.provider, "moot").inc()
            await self._finish(c, "done", "moot")
            return
        if c.provider_task_id is None:
            await self._without_provider_job(c)
            return
        adapter = self.adapters.get(c.provider)
        if adapter is None:
            log(logger, logging.ERROR, "no adapter for provider", provider=c.provider, alert=True)
            await self._retry(c, timedelta(seconds=self.config.auth_backoff_s), "no_adapter")
            return
        try:
            accepted = await adapter.cancel(c.provider_task_id)
        except (Rejected, Unsupported) as exc:
            CANCELS.labels(c.provider, "failed").inc()
            log(
                logger,
                logging.WARNING,
                "provider refused the cancel",
                provider=c.provider,
                error=str(exc),
            )
            await self._finish(c, "failed", "refused", type(exc).__name__)
            return
        except AuthFailed:
            CANCELS.labels(c.provider, "retried").inc()
            log(
                logger,
                logging.ERROR,
                "provider refused our credentials on cancel",
                provider=c.provider,
                alert=True,
            )
            await self._retry(c, timedelta(seconds=self.config.auth_backoff_s), "auth_failed")
            return
        except ProviderError as exc:
            if c.tries >= self.config.max_tries:
                CANCELS.labels(c.provider, "failed").inc()
                await self._finish(c, "failed", "gave_up", type(exc).__name__)
            else:
                CANCELS.labels(c.provider, "retried").inc()
                await self._retry(c, self._backoff(c), type(exc).__name__)
            return
        result = "accepted" if accepted else "already_terminal"
        CANCELS.labels(c.provider, result).inc()
        await self._finish(c, "done", result)
        await self._confirm(adapter, c, c.provider_task_id)

    async def _confirm(
        self, adapter: ProviderAdapter, c: CancelClaim, provider_task_id: str
    ) -> None:
        """One query right after the cancel, applied like a poll; failures are left to the poller
        and webhooks (the task stays ``cancel_requested`` meanwhile, which the poller queries)."""
        try:
            job = await adapter.query(provider_task_id)
        except ProviderError as exc:
            log(logger, logging.INFO, "cancel confirmation query failed", error=str(exc))
            return
        await self.state.apply(
            job.observation(adapter.name, c.attempt_id, Source.POLL, trace_id=c.trace_id)
        )

    async def _without_provider_job(self, c: CancelClaim) -> None:
        async with self.db.transaction() as conn:
            intent = await conn.fetchrow(q("lock_submit_intent"), c.attempt_id)
            state = intent["state"] if intent is not None else None
            if state in ("pending", "rejected", "canceled", None) and not (
                intent is not None and intent["maybe_sent"]
            ):
                if state == "pending":
                    await conn.execute(q("submit_intent_cancel"), c.attempt_id)
                await self.state.apply_in(
                    conn,
                    PlatformObservation(
                        kind=PlatformKind.CANCEL_CONFIRMED,
                        attempt_id=c.attempt_id,
                        source=Source.API,
                        trace_id=c.trace_id,
                    ),
                )
                await conn.execute(
                    q("cancel_intent_finish"), c.attempt_id, c.token, "done", "local", None
                )
                CANCELS.labels(c.provider, "local").inc()
                return
        # In flight, possibly sent, or unknown: the provider id will be recorded, then we cancel.
        CANCELS.labels(c.provider, "waiting").inc()
        delay = (
            timedelta(seconds=self.config.wait_submit_s)
            if state in ("pending", "sending")
            else self._backoff(c)
        )
        await self._retry(c, delay, f"submit_{state}")

    def _backoff(self, c: CancelClaim) -> timedelta:
        return backoff(c.tries, self.config.backoff_base_s, self.config.backoff_cap_s)

    async def _retry(self, c: CancelClaim, delay: timedelta, code: str) -> None:
        async with self.db.connection() as conn:
            await conn.execute(q("cancel_intent_retry"), c.attempt_id, c.token, delay, code)

    async def _finish(
        self, c: CancelClaim, state: str, result: str, code: str | None = None
    ) -> None:
        async with self.db.connection() as conn:
            await conn.execute(
                q("cancel_intent_finish"), c.attempt_id, c.token, state, result, code
            )
