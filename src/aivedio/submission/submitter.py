"""The submitter: claims due submit intents and sends each create exactly as often as is safe.

An intent is written with its attempt (``tasks.sql insert_attempt``), so every attempt is sent.
A round claims due intents with ``FOR UPDATE SKIP LOCKED`` and a lease token (any number of
replicas), calls ``adapter.submit`` with the attempt's ``client_request_id`` as idempotency key,
then records the outcome in one transaction:

accepted
    provider task id on the attempt (kept if a callback recorded it first), first poll time,
    ``SUBMIT_ACCEPTED`` through the state service (``no_change`` if a callback already moved the
    task: the id is recorded all the same), intent ``accepted``.
not sent (``ProviderUnavailable`` before sending, ``RateLimited``)
    back to pending with exponential backoff (``Retry-After`` honoured); after
    ``unavailable_max_tries`` the task fails with ``provider_unavailable`` unless a create may
    already exist.
unknown (``SubmitOutcomeUnknown``, a 2xx we cannot read, a lease that expired mid-send)
    a provider that honours idempotency keys gets the same key again (it returns the same job);
    any other is never sent again: intent ``unknown``, task ``submit_unknown``, and the
    reconciler looks the job up by ``client_request_id``.
rejected
    ``SUBMIT_REJECTED`` with the adapter's public code: the task fails.
auth failed
    no hot retry: one try per ``auth_backoff_s`` and an alert log line / metric.

Nothing here creates an attempt: the only way to a second generation is the operator's audited
``aivedio tasks resubmit`` (:mod:`aivedio.submission.resubmit`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg
from prometheus_client import Counter, Histogram

from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.public import PUBLIC_ERRORS
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log, trace_id_var
from aivedio.process.rounds import backoff, run_rounds
from aivedio.providers.port import (
    AuthFailed,
    MalformedResponse,
    NotFoundYet,
    ProviderAdapter,
    ProviderUnavailable,
    RateLimited,
    Rejected,
    SubmitOutcomeUnknown,
    SubmitRequest,
    SubmitResult,
    Unsupported,
)
from aivedio.state.service import StateService
from aivedio.submission.config import SubmitterConfig

logger = logging.getLogger("aivedio.submitter")

SUBMITS = Counter(
    "aivedio_submits_total",
    "Provider create calls, by provider and outcome (accepted, rate_limited, unavailable, "
    "unknown_retry, unknown, rejected, auth_failed, error)",
    ["provider", "outcome"],
)
SUBMIT_SECONDS = Histogram(
    "aivedio_submit_seconds",
    "Latency of one provider create call",
    ["provider"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SUBMIT_ALERTS = Counter(
    "aivedio_submit_alerts_total",
    "Conditions an operator must look at (auth_failed, unknown_provider, task_id_conflict)",
    ["provider", "kind"],
)


@dataclass(frozen=True, slots=True)
class Claimed:
    """One leased intent with what a create needs."""

    attempt_id: uuid.UUID
    task_id: uuid.UUID
    tries: int
    maybe_sent: bool
    previous_state: str
    provider: str
    model: str
    client_request_id: str
    prompt: str
    params: Mapping[str, Any]
    trace_id: str | None
    token: uuid.UUID

    @classmethod
    def of(cls, row: asyncpg.Record, token: uuid.UUID) -> Claimed:
        return cls(
            attempt_id=row["attempt_id"],
            task_id=row["task_id"],
            tries=row["tries"],
            maybe_sent=row["maybe_sent"] or row["previous_state"] == "sending",
            previous_state=row["previous_state"],
            provider=row["provider"],
            model=row["model"],
            client_request_id=row["client_request_id"],
            prompt=row["prompt"],
            params=row["params"] or {},
            trace_id=row["trace_id"],
            token=token,
        )


class Submitter:
    """One replica of the submitter role (run any number)."""

    def __init__(
        self,
        db: Database,
        state: StateService,
        adapters: Mapping[str, ProviderAdapter],
        config: SubmitterConfig | None = None,
    ) -> None:
        self.db = db
        self.state = state
        self.adapters = adapters
        self.config = config or SubmitterConfig()
        self.left = LeftLeases("submit_end_leases")
        """Intents whose outcome the database kept us from writing (:mod:`aivedio.db.leases`)."""

    async def run(self, stopping: asyncio.Event) -> None:
        await run_rounds(stopping, self.run_once, self.config.idle_sleep_s, logger, "submitter")

    async def run_once(self) -> int:
        """Claim one batch and submit it; the number of intents handled."""
        await self.left.give_back(self.db)
        token = uuid.uuid4()
        async with self.db.transaction() as conn:
            rows = await conn.fetch(
                q("claim_submit_intents"),
                self.config.batch_size,
                timedelta(seconds=self.config.lease_s),
                token,
            )
        claimed = [Claimed.of(row, token) for row in rows]
        await asyncio.gather(*(self._handle(c) for c in claimed))
        return len(claimed)

    # -- one intent -------------------------------------------------------------------------

    async def _handle(self, c: Claimed) -> None:
        trace_token = trace_id_var.set(c.trace_id)
        try:
            try:
                await self._submit(c)
            except DatabaseUnavailable:
                raise
            except Exception:
                # A bug after the call: the create may exist; keep the key.
                logger.exception("submit failed unexpectedly")
                SUBMITS.labels(c.provider, "error").inc()
                await self._retry(c, self._backoff(c), "internal_error", maybe_sent=True)
        except DatabaseUnavailable:
            # No outcome written: once the database is back the lease ends and the intent is
            # claimed as one whose lease lapsed mid-send (same key again, or unknown).
            self.left.add(c.attempt_id, c.token)
            raise
        finally:
            trace_id_var.reset(trace_token)

    async def _submit(self, c: Claimed) -> None:
        adapter = self.adapters.get(c.provider)
        if adapter is None:
            SUBMIT_ALERTS.labels(c.provider, "unknown_provider").inc()
            log(logger, logging.ERROR, "no adapter for provider", provider=c.provider, alert=True)
            await self._retry(c, timedelta(seconds=self.config.auth_backoff_s), "no_adapter")
            return
        honours = adapter.honours_idempotency_key
        if c.previous_state == "sending" and not honours:
            # A replica died mid-send: the create may exist and this provider would make another.
            await self._unknown(c, "lease_expired_mid_send")
            return
        if c.maybe_sent and honours and c.tries > self.config.same_key_max_tries:
            await self._unknown(c, "same_key_tries_exhausted")
            return
        request = SubmitRequest(
            client_request_id=c.client_request_id,
            model=c.model,
            prompt=c.prompt,
            params=dict(c.params),
            webhook_url=adapter.webhook_url_for(str(c.attempt_id)),
            metadata={"client_request_id": c.client_request_id, "attempt_id": str(c.attempt_id)},
        )
        await self._send(c, adapter, request)

    async def _send(self, c: Claimed, adapter: ProviderAdapter, request: SubmitRequest) -> None:
        """One create at the provider, and the outcome its answer (or error) leads to."""
        honours = adapter.honours_idempotency_key
        started = time.perf_counter()
        try:
            result = await adapter.submit(request)
        except RateLimited as exc:
            SUBMITS.labels(c.provider, "rate_limited").inc()
            delay = self._backoff(c)
            if exc.retry_after_s is not None:
                delay = max(delay, timedelta(seconds=exc.retry_after_s))
            await self._retry_or_give_up(c, delay, "rate_limited")
        except ProviderUnavailable as exc:
            if exc.status is not None and not honours:
                # The provider answered 5xx: it may have created the job before failing, and
                # this provider would create another one for a second send.
                SUBMITS.labels(c.provider, "unknown").inc()
                await self._unknown(c, f"http_{exc.status}")
            else:
                SUBMITS.labels(c.provider, "unavailable").inc()
                await self._retry_or_give_up(
                    c, self._backoff(c), f"http_{exc.status}" if exc.status else "transport"
                )
        except (SubmitOutcomeUnknown, MalformedResponse) as exc:
            code = "malformed" if isinstance(exc, MalformedResponse) else "outcome_unknown"
            if honours and c.tries < self.config.same_key_max_tries:
                SUBMITS.labels(c.provider, "unknown_retry").inc()
                await self._retry(c, self._backoff(c), code, maybe_sent=True)
            else:
                SUBMITS.labels(c.provider, "unknown").inc()
                await self._unknown(c, code)
        except Rejected as exc:
            SUBMITS.labels(c.provider, "rejected").inc()
            await self._rejected(c, exc.public_code, f"http_{exc.status}")
        except Unsupported:
            SUBMITS.labels(c.provider, "rejected").inc()
            await self._rejected(c, "submit_rejected", "unsupported")
        except (AuthFailed, NotFoundYet) as exc:
            # Our credentials or the endpoint are wrong: hot retries would only hammer it.
            kind = "auth_failed" if isinstance(exc, AuthFailed) else "endpoint_not_found"
            SUBMITS.labels(c.provider, "auth_failed").inc()
            SUBMIT_ALERTS.labels(c.provider, kind).inc()
            log(
                logger,
                logging.ERROR,
                "provider refused the create",
                provider=c.provider,
                kind=kind,
                alert=True,
            )
            await self._retry(c, timedelta(seconds=self.config.auth_backoff_s), kind)
        else:
            SUBMITS.labels(c.provider, "accepted").inc()
            await self._accepted(c, result)
        finally:
            SUBMIT_SECONDS.labels(c.provider).observe(time.perf_counter() - started)

    def _backoff(self, c: Claimed) -> timedelta:
        return backoff(c.tries, self.config.backoff_base_s, self.config.backoff_cap_s)

    # -- outcomes ---------------------------------------------------------------------------

    async def _accepted(self, c: Claimed, result: SubmitResult) -> None:
        first_poll = timedelta(
            seconds=random.uniform(self.config.first_poll_min_s, self.config.first_poll_max_s)
        )
        try:
            async with self.db.transaction() as conn:
                # Lock order everywhere: intent, task, attempt. The task row before the attempt
                # row, as the state service takes them (every event updates its attempt): with
                # the attempt first, a webhook applied meanwhile (callback before the submit
                # response) deadlocked with this transaction in an aivedio chaos run.
                await conn.execute(q("submit_intent_accepted"), c.attempt_id)
                await conn.execute(q("lock_task_for_attempt"), c.attempt_id)
                recorded = await conn.fetchval(
                    q("record_provider_task_id"), c.attempt_id, result.provider_task_id, first_poll
                )
                if recorded != result.provider_task_id:
                    SUBMIT_ALERTS.labels(c.provider, "task_id_conflict").inc()
                    log(
                        logger,
                        logging.ERROR,
                        "provider returned another task id",
                        attempt_id=str(c.attempt_id),
                        alert=True,
                    )
                await self.state.apply_in(
                    conn,
                    PlatformObservation(
                        kind=PlatformKind.SUBMIT_ACCEPTED,
                        attempt_id=c.attempt_id,
                        source=Source.SUBMIT,
                        trace_id=c.trace_id,
                    ),
                )
        except asyncpg.UniqueViolationError:
            # Another attempt already holds this provider id: never map one job to two attempts.
            SUBMIT_ALERTS.labels(c.provider, "task_id_conflict").inc()
            log(
                logger,
                logging.ERROR,
                "provider task id belongs to another attempt",
                attempt_id=str(c.attempt_id),
                alert=True,
            )
            await self._unknown(c, "provider_task_id_conflict")
            return
        log(
            logger,
            logging.INFO,
            "submitted",
            attempt_id=str(c.attempt_id),
            provider=c.provider,
            replayed=result.replayed,
        )

    async def _retry(
        self, c: Claimed, delay: timedelta, code: str, *, maybe_sent: bool = False
    ) -> None:
        async with self.db.connection() as conn:
            await conn.execute(
                q("submit_intent_retry"), c.attempt_id, c.token, delay, code, maybe_sent
            )

    async def _retry_or_give_up(self, c: Claimed, delay: timedelta, code: str) -> None:
        if c.tries < self.config.unavailable_max_tries:
            await self._retry(c, delay, code)
        elif c.maybe_sent:
            await self._unknown(c, code)
        else:
            await self._rejected(c, "provider_unavailable", code)

    async def _unknown(self, c: Claimed, code: str) -> None:
        await self._finish(c, "unknown", code, PlatformKind.SUBMIT_UNKNOWN, None)
        log(
            logger,
            logging.WARNING,
            "submit outcome unknown",
            attempt_id=str(c.attempt_id),
            provider=c.provider,
            code=code,
        )

    async def _rejected(self, c: Claimed, public_code: str, code: str) -> None:
        await self._finish(c, "rejected", code, PlatformKind.SUBMIT_REJECTED, public_code)

    async def _finish(
        self,
        c: Claimed,
        state: str,
        code: str,
        kind: PlatformKind,
        public_code: str | None,
    ) -> None:
        async with self.db.transaction() as conn:
            mine = await conn.fetchval(
                q("submit_intent_finish"), c.attempt_id, c.token, state, code
            )
            if mine is None:  # the lease was taken over; the new holder decides
                return
            await self.state.apply_in(
                conn,
                PlatformObservation(
                    kind=kind,
                    attempt_id=c.attempt_id,
                    source=Source.SUBMIT,
                    error_code=public_code,
                    error_message=PUBLIC_ERRORS.get(public_code) if public_code else None,
                    trace_id=c.trace_id,
                ),
            )
