"""The poll scheduler and its workers (seed §12.6.2, §12.12.2).

One loop per process claims due attempts from PostgreSQL (``FOR UPDATE SKIP LOCKED`` plus a
lease fenced by a token, so any number of replicas run side by side), takes rate-limit tokens
for them (four levels, all or none), and starts one query task per granted attempt, at most
``concurrency`` at once. A query's answer goes through ``StateService.apply_in`` with
``Source.POLL`` (the same path as a webhook) and the next due time, the counters and the end of
the lease are written in the same transaction. Attempts that got no token or whose provider's
breaker is open are given back with a short lease and keep their ``next_poll_at``, hence their
place in the queue; the loop then sleeps for the limiter's wait hint instead of spinning.

Intervals come from the pure :mod:`aivedio.polling.policy`, stretched by the ratio of the poll
demand in flight (re-read every ``stretch_refresh_s``) to the rate limits, so the scheduler
targets intervals it can keep. A query failure never fails a task: after N consecutive ones the
task becomes ``status_unknown``.

Elsewhere: a claimed attempt and its query's records (:mod:`~aivedio.polling.claimed`), the
breakers (:mod:`~aivedio.polling.breakers`), the stretch (:mod:`~aivedio.polling.stretch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping

import asyncpg
import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge, Histogram

from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.statuses import Status
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log
from aivedio.polling.breakers import Breakers, allowance, feed
from aivedio.polling.claimed import POLLED_STATUSES, Claimed, PollerStats, PollRecord, teaches
from aivedio.polling.config import PollerConfig
from aivedio.polling.policy import (
    AttemptFacts,
    BreakerState,
    Outcome,
    PollDecision,
    after_failure,
    after_success,
    scheduled_delay,
)
from aivedio.polling.ratelimit import RateLimiter, Scope, watched
from aivedio.polling.stretch import scope_stretch
from aivedio.process import health
from aivedio.providers.port import (
    AuthFailed,
    JobState,
    MalformedResponse,
    NotFoundYet,
    ProviderAdapter,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
)
from aivedio.providers.redact import sample_of
from aivedio.state.service import StateService

logger = logging.getLogger("aivedio.polling")

QUERIES = Counter(
    "aivedio_poll_queries_total", "Provider queries by the poller", ["provider", "outcome"]
)
LAG = Histogram(
    "aivedio_poll_lag_seconds",
    "How late a claimed attempt was (claim time - next_poll_at)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
STRETCH = Gauge(
    "aivedio_poll_stretch",
    "Interval stretch forced by the rate limits (max over scopes)",
    ["provider"],
)
LIMITER_WAITS = Histogram(
    "aivedio_poll_limiter_wait_seconds",
    "Waits the rate limiter imposed: one per scope and round that got fewer tokens than it "
    "asked for, the wait until the next token (the rows not granted are given back for it)",
    ["provider"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
ALERTS = Counter("aivedio_poll_alerts_total", "Poller alerts", ["provider", "alert"])
LEASES_LOST = Counter("aivedio_poll_leases_lost_total", "Results dropped: the lease had lapsed")
RELEASED = Counter(
    "aivedio_poll_released_total", "Claimed attempts given back unqueried", ["reason"]
)


class Poller:
    """One poller replica: a claim loop and up to ``concurrency`` queries in flight."""

    def __init__(
        self,
        db: Database,
        state: StateService,
        adapters: Mapping[str, ProviderAdapter],
        limiter: RateLimiter,
        config: PollerConfig | None = None,
        *,
        redis: aioredis.Redis | None = None,
        rand: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
        on_poll: Callable[[PollRecord], None] | None = None,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        self.db = db
        self.state = state
        self.adapters = dict(adapters)
        self.limiter = limiter
        self.config = config or PollerConfig()
        self.redis = redis
        self.rand = rand or random.Random()
        self.clock = clock
        self.name = name or uuid.uuid4().hex[:8]
        self.on_poll = on_poll
        self.credentials = dict(credentials or {})
        self.stats = PollerStats()
        self.breakers: Breakers = {}
        self._demand: dict[tuple[str, str, str], float] = {}
        self._stretch: dict[Scope, float] = {}
        self._demand_at = -float("inf")
        self._budget = self.config.batch
        self._tasks: set[asyncio.Task[None]] = set()
        self.left = LeftLeases("poll_end_leases")  # polls the database interrupted

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Claim and query until ``stopping`` is set; then let the queries in flight finish."""
        log(logger, logging.INFO, "poller running", replica=self.name)
        try:
            while not stopping.is_set():
                try:
                    pause = await self.step()
                    health.recovered()
                except DatabaseUnavailable as exc:
                    log(logger, logging.WARNING, "poller: database unavailable", error=str(exc))
                    health.outage("database", exc)
                    pause = 1.0
                if pause > 0:
                    await _sleep_unless(stopping, pause)
        finally:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def step(self) -> float:
        """One round: claim what is due and start its queries. Returns how long to wait."""
        cfg = self.config
        free = cfg.concurrency - len(self._tasks)
        if free <= 0:
            await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
            return 0.0
        await self.left.give_back(self.db)
        await self._refresh_demand()
        rows = await self._claim(min(free, self._budget))
        if not rows:
            return cfg.idle_s * self.rand.uniform(0.8, 1.2)
        waits = await self._dispatch(rows)
        if waits is None:  # everything went out: claim more next round
            self._budget = min(cfg.batch, self._budget * 2)
            return 0.0
        return min(1.0, max(0.02, waits))

    async def _claim(self, want: int) -> list[Claimed]:
        skip = [
            provider
            for (provider, _), b in self.breakers.items()
            if b.current(self.clock()).state is BreakerState.OPEN
        ]
        scan = max(want * 4, want + 16)
        async with self.db.connection() as conn:
            records = await conn.fetch(
                q("poll_claim"), list(POLLED_STATUSES), scan, want, self.config.lease_s, skip
            )
        self.stats.claims += 1
        self.stats.statements += 1
        rows = [Claimed.of(r) for r in records]
        if records:
            self.stats.stopped += records[0]["stopped"]
        self.stats.claimed += len(rows)
        for row in rows:
            LAG.observe(max(0.0, row.lag_s))
        return rows

    async def _dispatch(self, rows: list[Claimed]) -> float | None:
        """Start the queries the breakers and tokens allow; give the rest back. Returns the
        shortest wait hint when something was given back, None when everything went out."""
        groups: dict[Scope, list[Claimed]] = defaultdict(list)
        for row in rows:
            groups[row.scope].append(row)
        watching = await watched(
            self.redis,
            ((r.task_id, r.project_id) for r in rows),
            prefix=self.config.interest_prefix,
        )
        give_back: list[tuple[Claimed, float, str]] = []
        granted_total = 0
        for scope, members in groups.items():
            allowed, wait = allowance(self.breakers, scope.provider, len(members), self.clock())
            for row in members[allowed:]:
                give_back.append((row, wait, "breaker"))
            members = members[:allowed]
            if not members:
                continue
            grant = await self.limiter.take(scope, len(members))
            granted_total += grant.granted
            if grant.granted < len(members):
                LIMITER_WAITS.labels(scope.provider).observe(max(grant.wait_s, 0.05))
            for row in members[grant.granted :]:
                give_back.append((row, max(grant.wait_s, 0.05), "tokens"))
            for row in members[: grant.granted]:
                self._start(row, str(row.task_id) in watching)
        if not give_back:
            return None
        self._budget = max(1, granted_total)
        try:
            await self._release(give_back)
        except DatabaseUnavailable:
            for row, _, _ in give_back:
                self.left.add(row.attempt_id, row.token)
            raise
        return min(wait for _, wait, _ in give_back)

    async def _release(self, rows: list[tuple[Claimed, float, str]]) -> None:
        async with self.db.connection() as conn:
            await conn.execute(
                q("poll_release"),
                [r.attempt_id for r, _, _ in rows],
                [r.token for r, _, _ in rows],
                [w for _, w, _ in rows],
            )
        self.stats.statements += 1
        self.stats.released += len(rows)
        for _, _, reason in rows:
            RELEASED.labels(reason).inc()

    def _start(self, row: Claimed, is_watched: bool) -> None:
        task = asyncio.create_task(self._poll_guarded(row, is_watched))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one query ------------------------------------------------------------------------

    async def _poll_guarded(self, row: Claimed, is_watched: bool) -> None:
        try:
            await self.poll(row, is_watched)
        except DatabaseUnavailable as exc:  # polled again once it is back (aivedio.db.leases)
            log(logger, logging.WARNING, "poll result not written", error=str(exc))
            self.left.add(row.attempt_id, row.token)
        except Exception as exc:  # a bug must not kill the loop; the lease lapses
            log(
                logger,
                logging.ERROR,
                "poll failed",
                attempt_id=str(row.attempt_id),
                error=repr(exc),
            )

    async def poll(self, row: Claimed, is_watched: bool = False) -> PollRecord:
        """Query one claimed attempt and write what it taught."""
        sent = time.time()
        outcome, job, retry_after, sample = await self._query(row)
        answered = time.time()
        credential = self.credentials.get(row.provider, "default")
        feed(self.breakers, row.provider, credential, outcome, self.config, self.clock())
        QUERIES.labels(row.provider, str(outcome)).inc()
        self.stats.polls += 1
        self.stats.outcomes[str(outcome)] += 1
        changed = job is not None and teaches(row, job)
        decision = self._decide(row, job, changed, outcome, retry_after, is_watched)
        stretch = self.stretch(row.scope)
        delay = scheduled_delay(decision, stretch)
        written = await self._write(row, job, changed, outcome, decision, delay, sample)
        record = PollRecord(
            attempt_id=row.attempt_id,
            replica=self.name,
            sent_at=sent,
            answered_at=answered,
            outcome=outcome,
            delay_s=written,
            nominal_s=decision.nominal_s,
            stretch=stretch,
            lag_s=row.lag_s,
        )
        if self.on_poll is not None:
            self.on_poll(record)
        return record

    async def _query(
        self, row: Claimed
    ) -> tuple[Outcome, JobState | None, float | None, str | None]:
        """Ask the provider: the outcome, the job when it answered, its retry-after hint and a
        sample of what could not be read."""
        adapter = self.adapters.get(row.provider)
        job: JobState | None = None
        retry_after: float | None = None
        sample: str | None = None
        if adapter is None:
            return Outcome.MALFORMED, None, None, f"no adapter for provider {row.provider!r}"
        try:
            async with asyncio.timeout(self.config.lease_s / 2):
                job = await adapter.query(row.provider_task_id)
            outcome = Outcome.OK
        except RateLimited as exc:
            outcome, retry_after = Outcome.RATE_LIMITED, exc.retry_after_s
            await self.limiter.penalize(row.provider, retry_after or 1.0)
        except (ProviderUnavailable, TimeoutError):
            outcome = Outcome.UNAVAILABLE
        except NotFoundYet:
            outcome = Outcome.NOT_FOUND
        except AuthFailed:
            outcome = Outcome.AUTH_FAILED
        except MalformedResponse as exc:
            outcome, sample = Outcome.MALFORMED, exc.sample
        except ProviderError as exc:  # Rejected / Unsupported: not what a query answers
            outcome, sample = Outcome.MALFORMED, sample_of(str(exc))
        return outcome, job, retry_after, sample

    def _decide(
        self,
        row: Claimed,
        job: JobState | None,
        changed: bool,
        outcome: Outcome,
        retry_after: float | None,
        is_watched: bool,
    ) -> PollDecision:
        """The policy's decision after this query, its alerts raised."""
        facts = AttemptFacts(
            task_status=row.status,
            provider_status=row.provider_status,
            age_s=row.age_s,
            unchanged=row.unchanged,
            failures=row.failures,
            watched=is_watched,
        )
        if job is not None:
            decision = after_success(
                facts, changed, self.config.policy, self.rand, provider_status=job.status
            )
        else:
            decision = after_failure(
                facts, outcome, self.config.policy, self.rand, retry_after_s=retry_after
            )
        for alert in decision.alerts:
            ALERTS.labels(row.provider, str(alert)).inc()
            log(
                logger,
                logging.ERROR if alert == "auth_failed" else logging.WARNING,
                "poller alert",
                alert=str(alert),
                provider=row.provider,
                attempt_id=str(row.attempt_id),
                failures=decision.failures,
            )
        return decision

    async def _write(
        self,
        row: Claimed,
        job: JobState | None,
        changed: bool,
        outcome: Outcome,
        decision: PollDecision,
        delay: float,
        sample: str | None,
    ) -> float | None:
        """Apply and reschedule, in one transaction when there is something to apply."""
        args = (
            row.attempt_id,
            row.token,
            delay,
            decision.nominal_s,
            decision.failures,
            decision.unchanged,
            None if outcome is Outcome.OK else str(outcome),
            sample,
            list(POLLED_STATUSES),
        )
        skip = (
            job is not None
            and self.config.skip_unchanged
            and not changed
            and row.status is not Status.STATUS_UNKNOWN
            and job.status is row.provider_status
            and job.sequence is not None
        )
        needs_tx = (job is not None and not skip) or decision.status_unknown or decision.reconcile
        if not needs_tx:
            self.stats.skipped += job is not None
            async with self.db.connection() as conn:
                result = await conn.fetchrow(q("poll_reschedule"), *args)
            self.stats.statements += 1
            return self._written(row, result)
        async with self.db.transaction() as conn:
            statements = 3  # BEGIN, the reschedule, COMMIT
            statements += await self._apply_in(conn, row, job, outcome, decision, sample)
            result = await conn.fetchrow(q("poll_reschedule"), *args)
        self.stats.statements += statements
        return self._written(row, result)

    async def _apply_in(
        self,
        conn: asyncpg.Connection,
        row: Claimed,
        job: JobState | None,
        outcome: Outcome,
        decision: PollDecision,
        sample: str | None,
    ) -> int:
        """What the query taught, in the transaction ``conn``: the provider's answer, the
        attempt given up as ``status_unknown``, a reconcile request. How many statements."""
        statements = 0
        if job is not None:
            obs = job.observation(row.provider, row.attempt_id, Source.POLL)
            applied = await self.state.apply_in(conn, obs)
            statements += 2
            self.stats.applied += applied.event is not None
        if decision.status_unknown:
            await self.state.apply_in(
                conn,
                PlatformObservation(
                    kind=PlatformKind.STATUS_UNKNOWN,
                    attempt_id=row.attempt_id,
                    source=Source.POLL,
                ),
            )
            statements += 2
        if decision.reconcile is not None:
            await conn.execute(
                q("poll_reconcile"),
                row.attempt_id,
                str(decision.reconcile),
                {
                    "outcome": str(outcome),
                    "failures": decision.failures,
                    "provider_task_id": row.provider_task_id,
                    "sample": sample,
                },
            )
            statements += 1
        return statements

    def _written(self, row: Claimed, result: asyncpg.Record | None) -> float | None:
        if result is None:
            self.stats.leases_lost += 1
            LEASES_LOST.inc()
            log(logger, logging.WARNING, "poll lease lost", attempt_id=str(row.attempt_id))
            return None
        delay: float | None = result["delay_s"]
        return delay

    # -- stretch ----------------------------------------------------------------------------

    async def _refresh_demand(self) -> None:
        now = self.clock()
        if now - self._demand_at < self.config.stretch_refresh_s:
            return
        self._demand_at = now
        default = self.config.policy.running.base_s
        async with self.db.connection() as conn:
            records = await conn.fetch(q("poll_demand"), default)
        self.stats.statements += 1
        self._demand = {(r["provider"], r["model"], r["tenant"]): r["demand_qps"] for r in records}
        self._stretch.clear()
        worst: dict[str, float] = defaultdict(lambda: 1.0)
        for provider, model, tenant in self._demand:
            scope = Scope(provider, model, tenant)
            worst[provider] = max(worst[provider], self.stretch(scope))
        for provider, value in worst.items():
            STRETCH.labels(provider).set(value)

    def stretch(self, scope: Scope) -> float:
        """How much the rate limits stretch the intervals of ``scope``'s attempts."""
        cached = self._stretch.get(scope)
        if cached is not None:
            return cached
        value = scope_stretch(self._demand, self.limiter.config, scope, self.config.utilization)
        self._stretch[scope] = value
        return value


async def _sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


__all__ = ["Poller"]
