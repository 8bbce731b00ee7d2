"""``apply_observation``: webhook, poll, reconcile, submit and media paths all call exactly this.

One transaction: lock the task (the aggregate lock), decide with the pure core, and either write
version + 1 with its stream seq, task event and outbox row (``write_event``), or record why
nothing changed (``record_unapplied``). All or nothing.

``apply_many`` is group commit: a batch of observations in one transaction (one COMMIT, one WAL
flush), each decided exactly as ``apply`` would decide it one after the other.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
from prometheus_client import Counter, Histogram

from aivedio.config import StateConfig
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import (
    Observation,
    ProviderObservation,
)
from aivedio.domain.transitions import (
    AttemptChange,
    AttemptView,
    CoalescePolicy,
    Decision,
    Outcome,
    Reason,
    TaskChange,
    decide,
    progress_only,
)
from aivedio.errors import AivedioError, DatabaseUnavailable
from aivedio.state.decided import (
    Locked,
    Pending,
    evolve,
    locked_from,
    observed,
    record_unapplied,
)
from aivedio.state.events import (
    PROGRESS_CHANGED,
    STATUS_CHANGED,
    AuditRow,
    EventWritten,
    NewEvent,
    write_event,
    write_events,
)

OBSERVATIONS = Counter(
    "aivedio_observations_total",
    "Observations given to the state service, by source, outcome and reason",
    ["source", "outcome", "reason"],
)
APPLY_SECONDS = Histogram(
    "aivedio_apply_observation_seconds",
    "Time to apply one observation (its share of a batch): with the commit where the state "
    "service owns the transaction, without it inside a caller's",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
BATCHES = Counter(
    "aivedio_apply_batches_total",
    "apply_many batches, by how they ended: committed as one transaction, or applied one by one "
    "after the batch failed",
    ["result"],
)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: Outcome
    reason: Reason | None
    task_id: uuid.UUID | None
    task_version: int | None  # the version after this observation
    event: EventWritten | None


class BatchPartlyFailed(AivedioError):
    """``apply_many`` fell back to one transaction per observation and some of them failed.

    ``results[i]`` is the ``ApplyResult`` of observation ``i``, or the exception it raised; the
    others were applied (each in its own transaction).
    """

    def __init__(self, results: list[ApplyResult | Exception]) -> None:
        failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
        super().__init__(f"{len(failed)} of {len(results)} observations failed: {failed}")
        self.results = results


class StateService:
    """The only writer of task state."""

    def __init__(
        self,
        db: Database,
        config: StateConfig | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.db = db
        config = config or StateConfig()
        self.policy = CoalescePolicy(config.coalesce_min_points, config.coalesce_min_interval)
        self.clock = clock

    async def apply(self, obs: Observation) -> ApplyResult:
        """Apply one observation in its own transaction."""
        started = time.perf_counter()
        async with self.db.transaction() as conn:
            result = await self._apply_in(conn, obs)
        APPLY_SECONDS.observe(time.perf_counter() - started)
        return result

    async def apply_in(
        self, conn: asyncpg.Connection, obs: Observation, *, locked: bool = False
    ) -> ApplyResult:
        """Apply one observation inside the caller's transaction (timed without its commit).
        ``locked``: the caller's transaction has locked the task of ``obs``'s attempt already
        (the inbox processor's ``inbox_take_claimed`` does, in the statement that takes its
        row), so the lock's own round trip is saved; without that lock the decision could be
        made on a stale task."""
        started = time.perf_counter()
        result = await self._apply_in(conn, obs, locked=locked)
        APPLY_SECONDS.observe(time.perf_counter() - started)
        return result

    async def _apply_in(
        self, conn: asyncpg.Connection, obs: Observation, *, locked: bool = False
    ) -> ApplyResult:
        row = None
        if obs.attempt_id is not None and (
            locked or await conn.fetchval(q("lock_task_for_attempt"), obs.attempt_id) is not None
        ):
            row = await conn.fetchrow(q("locked_attempts"), [obs.attempt_id])
        task = locked_from(row) if row is not None else None
        decision = self._decide(task, obs)
        return self._count(obs, await self._write(conn, Pending(0, obs, task, decision)))

    async def apply_many(self, observations: Sequence[Observation]) -> list[ApplyResult]:
        """Apply a batch in one transaction: one COMMIT (one WAL flush) for all of them.

        Each observation is decided exactly as ``apply`` would decide it, in the given order,
        against the task as the observations before it left it; events take contiguous stream
        seqs and task versions, in the given order within a project. All task rows are locked in
        one statement in task id order; the audit rows of unapplied observations follow, then
        every event in one ``write_events`` statement that locks the stream rows in project id
        order, so concurrent batches (and ``apply``) cannot deadlock.

        If the batch fails for any reason but the database being unavailable, its transaction
        rolls back and the observations are applied one by one with ``apply``, so one bad
        observation cannot block the others; if some of those fail, ``BatchPartlyFailed``
        carries every result and error after the others were applied. ``DatabaseUnavailable``
        propagates (the batch wrote nothing).
        """
        if not observations:
            return []
        started = time.perf_counter()
        try:
            async with self.db.transaction() as conn:
                results = await self._apply_batch_in(conn, observations, locked=False)
        except DatabaseUnavailable:
            raise
        except Exception:
            BATCHES.labels("one_by_one").inc()
            return await self._apply_one_by_one(observations)
        BATCHES.labels("committed").inc()
        elapsed = time.perf_counter() - started
        for obs, result in zip(observations, results, strict=True):
            APPLY_SECONDS.observe(elapsed / len(observations))
            self._count(obs, result)
        return results

    async def apply_many_in(
        self,
        conn: asyncpg.Connection,
        observations: Sequence[Observation],
        *,
        locked: bool = False,
    ) -> list[ApplyResult]:
        """``apply_many`` inside the caller's transaction (no fallback: an error is the
        caller's, and its transaction is to be rolled back). Each observation is timed as its
        share of the batch, without the caller's commit. ``locked``: the caller's transaction
        has locked the tasks of every observation's attempt already, in task id order (see
        ``apply_in``)."""
        started = time.perf_counter()
        results = await self._apply_batch_in(conn, observations, locked=locked)
        share = (time.perf_counter() - started) / max(1, len(observations))
        for obs, result in zip(observations, results, strict=True):
            APPLY_SECONDS.observe(share)
            self._count(obs, result)
        return results

    async def _apply_batch_in(
        self, conn: asyncpg.Connection, observations: Sequence[Observation], *, locked: bool
    ) -> list[ApplyResult]:
        if not observations:
            return []
        attempt_ids = sorted({o.attempt_id for o in observations if o.attempt_id is not None})
        if not locked:
            await conn.execute(q("lock_tasks_for_attempts"), attempt_ids)
        rows = await conn.fetch(q("locked_attempts"), attempt_ids)
        now: datetime | None = rows[0]["locked_at"] if rows else None
        by_attempt = {row["attempt_id"]: row for row in rows}
        tasks: dict[uuid.UUID, Locked] = {}  # task id -> its state as the batch evolves it
        attempts: dict[uuid.UUID, AttemptView] = {}
        for row in rows:
            first = locked_from(row)
            tasks.setdefault(first.ref.task_id, first)
            attempts[first.attempt.id] = first.attempt
        pending: list[Pending] = []
        for index, obs in enumerate(observations):
            found = by_attempt.get(obs.attempt_id) if obs.attempt_id is not None else None
            if found is None:
                pending.append(Pending(index, obs, None, self._decide(None, obs)))
                continue
            assert now is not None
            current = tasks[found["id"]]
            view = Locked(current.ref, current.task, attempts[found["attempt_id"]])
            decision = self._decide(view, obs)
            pending.append(Pending(index, obs, view, decision))
            evolved = evolve(view, decision, now)
            tasks[found["id"]] = evolved
            attempts[found["attempt_id"]] = evolved.attempt
        return await self._write_batch(conn, pending)

    async def _write_batch(
        self, conn: asyncpg.Connection, pending: list[Pending]
    ) -> list[ApplyResult]:
        """Audit rows first, all in one statement, in the decided order; then every event in one
        ``write_events`` statement (the stream rows are locked last, for the shortest time).

        An attempt ends with the values of its last attempt change in the batch, from an event
        or an audit row: each event that records the attempt writes those final values.
        """
        final: dict[uuid.UUID, AttemptChange] = {}
        for item in pending:
            if item.locked is not None and item.decision.attempt is not None:
                final[item.locked.attempt.id] = item.decision.attempt
        results: list[ApplyResult | None] = [None] * len(pending)
        events: list[tuple[Pending, NewEvent]] = []
        unapplied: list[Pending] = []
        for item in pending:
            locked, decision = item.locked, item.decision
            if locked is None or decision.outcome is not Outcome.APPLIED:
                unapplied.append(item)
                results[item.index] = _unapplied(item)
                continue
            assert decision.change is not None
            attempt_change = decision.attempt
            if attempt_change is not None:
                attempt_change = final[locked.attempt.id]
            events.append((item, _new_event(item, locked, decision.change, attempt_change)))
        if unapplied:
            await record_unapplied(conn, unapplied)
        events.sort(key=lambda e: e[0].order)  # stable: decided order within a project
        written = await write_events(conn, [event for _, event in events])
        for (item, _), event in zip(events, written, strict=True):
            assert item.locked is not None
            results[item.index] = ApplyResult(
                Outcome.APPLIED, item.decision.reason, item.locked.task.id, event.version, event
            )
        return [r for r in results if r is not None]

    async def _apply_one_by_one(self, observations: Sequence[Observation]) -> list[ApplyResult]:
        results: list[ApplyResult | Exception] = []
        for obs in observations:
            try:
                results.append(await self.apply(obs))
            except DatabaseUnavailable:
                raise
            except Exception as exc:  # one bad observation does not block the others
                results.append(exc)
        if any(isinstance(r, Exception) for r in results):
            raise BatchPartlyFailed(results)
        return [r for r in results if isinstance(r, ApplyResult)]

    def _decide(self, locked: Locked | None, obs: Observation) -> Decision:
        if locked is None:
            return Decision(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT)
        return decide(locked.task, locked.attempt, obs, self.clock(), self.policy)

    async def _write(self, conn: asyncpg.Connection, item: Pending) -> ApplyResult:
        """The decided observation's write: its event (applied) or its audit row."""
        locked, decision = item.locked, item.decision
        if locked is None or decision.outcome is not Outcome.APPLIED:
            await record_unapplied(conn, [item])
            return _unapplied(item)
        assert decision.change is not None
        event = _new_event(item, locked, decision.change, decision.attempt)
        written = await write_event(conn, event.ref, **event.params())
        return ApplyResult(
            Outcome.APPLIED, decision.reason, locked.task.id, written.version, written
        )

    @staticmethod
    def _count(obs: Observation, result: ApplyResult) -> ApplyResult:
        reason = str(result.reason) if result.reason is not None else ""
        OBSERVATIONS.labels(str(obs.source), str(result.outcome), reason).inc()
        return result


def _unapplied(item: Pending) -> ApplyResult:
    """The result of an observation that changed nothing (``record_unapplied`` writes its row)."""
    if item.locked is None:
        return ApplyResult(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT, None, None, None)
    task = item.locked.task
    return ApplyResult(item.decision.outcome, item.decision.reason, task.id, task.version, None)


def _new_event(
    item: Pending, locked: Locked, change: TaskChange, attempt_change: AttemptChange | None
) -> NewEvent:
    obs = item.obs
    provider = obs if isinstance(obs, ProviderObservation) else None
    audit = None
    if not item.decision.public:  # a new version, but no public event: its audit row instead
        audit = AuditRow(
            reason=str(item.decision.reason),
            observed=observed(obs),
            received_at=obs.received_at,
            provider=provider.provider if provider else None,
            provider_sequence=provider.provider_sequence if provider else None,
            progress=obs.progress,
            dedup_key=provider.dedup_key if provider else None,
        )
    return NewEvent(
        ref=locked.ref,
        attempt_id=locked.attempt.id,
        version=locked.task.version + 1,
        change=change,
        source=str(obs.source),
        trace_id=obs.trace_id,
        occurred_at=_occurred_at(obs),
        attempt_change=attempt_change,
        inbox_id=provider.inbox_id if provider else None,
        audit=audit,
        event_type=PROGRESS_CHANGED if progress_only(locked.task, change) else STATUS_CHANGED,
    )


def _occurred_at(obs: Observation) -> datetime:
    if isinstance(obs, ProviderObservation) and obs.provider_occurred_at is not None:
        return obs.provider_occurred_at
    return obs.received_at


__all__ = ["ApplyResult", "BatchPartlyFailed", "StateService"]
