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
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import asyncpg
from prometheus_client import Counter, Histogram

from aivedio.config import StateConfig
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import (
    Observation,
    ProviderObservation,
    ProviderStatus,
)
from aivedio.domain.statuses import Stage, Status
from aivedio.domain.transitions import (
    AttemptChange,
    AttemptView,
    CoalescePolicy,
    Decision,
    Outcome,
    Reason,
    TaskChange,
    TaskView,
    decide,
    progress_only,
)
from aivedio.errors import AivedioError, DatabaseUnavailable
from aivedio.state.events import (
    PROGRESS_CHANGED,
    STATUS_CHANGED,
    AuditRow,
    EventWritten,
    NewEvent,
    TaskRef,
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


def task_view(row: asyncpg.Record) -> TaskView:
    return TaskView(
        id=row["id"],
        status=Status(row["status"]),
        stage=Stage(row["stage"]),
        progress=row["progress"],
        version=row["version"],
        current_attempt_id=row["current_attempt_id"],
        progress_event_at=row["progress_event_at"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        asset_id=row["asset_id"],
    )


def attempt_view(row: asyncpg.Record) -> AttemptView | None:
    if row["attempt_id"] is None:
        return None
    status = row["provider_status"]
    return AttemptView(
        id=row["attempt_id"],
        provider_status=ProviderStatus(status) if status is not None else None,
        last_provider_seq=row["last_provider_seq"],
        last_provider_at=row["last_provider_at"],
    )


@dataclass(frozen=True, slots=True)
class _Locked:
    """A locked task as the next observation sees it: the row, or its state evolved in memory
    by the observations before it in the same batch."""

    ref: TaskRef
    task: TaskView
    attempt: AttemptView


def _locked(row: asyncpg.Record) -> _Locked:
    attempt = attempt_view(row)
    assert attempt is not None  # lock_task(s)_for_attempt(s) start from the attempt
    ref = TaskRef(row["id"], row["project_id"], row["tenant_id"], row["user_id"])
    return _Locked(ref, task_view(row), attempt)


def _evolve(locked: _Locked, decision: Decision, now: datetime) -> _Locked:
    """What ``write_event`` / ``record_unapplied`` do to the task and the attempt, in memory
    (``progress_event_at = now()`` is the transaction's start time)."""
    attempt = locked.attempt
    if decision.attempt is not None:
        attempt = replace(
            attempt,
            provider_status=decision.attempt.provider_status,
            last_provider_seq=decision.attempt.last_provider_seq,
            last_provider_at=decision.attempt.last_provider_at,
        )
    task = locked.task
    if decision.outcome is Outcome.APPLIED:
        change = decision.change
        assert change is not None
        task = replace(
            task,
            status=change.status,
            stage=change.stage,
            progress=change.progress,
            version=task.version + 1,
            progress_event_at=now if decision.public else task.progress_event_at,
            error_code=change.error_code,
            error_message=change.error_message,
            asset_id=change.asset_id,
        )
    return _Locked(locked.ref, task, attempt)


@dataclass(frozen=True, slots=True)
class _Pending:
    """One decided observation of a batch, waiting for its write."""

    index: int
    obs: Observation
    locked: _Locked | None  # before the decision; None: unknown attempt
    decision: Decision

    @property
    def order(self) -> uuid.UUID:
        """Writes go in project order (stream row locks in one order across batches)."""
        return self.locked.ref.project_id if self.locked is not None else _NO_PROJECT


_NO_PROJECT = uuid.UUID(int=0)


def _observed(obs: Observation) -> str:
    if isinstance(obs, ProviderObservation):
        return str(obs.status)
    if obs.stage is not None:
        return f"{obs.kind}:{obs.stage}"
    return str(obs.kind)


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
        task = _locked(row) if row is not None else None
        decision = self._decide(task, obs)
        return self._count(obs, await self._write(conn, _Pending(0, obs, task, decision)))

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
        tasks: dict[uuid.UUID, _Locked] = {}  # task id -> its state as the batch evolves it
        attempts: dict[uuid.UUID, AttemptView] = {}
        for row in rows:
            first = _locked(row)
            tasks.setdefault(first.ref.task_id, first)
            attempts[first.attempt.id] = first.attempt
        pending: list[_Pending] = []
        for index, obs in enumerate(observations):
            found = by_attempt.get(obs.attempt_id) if obs.attempt_id is not None else None
            if found is None:
                pending.append(_Pending(index, obs, None, self._decide(None, obs)))
                continue
            assert now is not None
            current = tasks[found["id"]]
            view = _Locked(current.ref, current.task, attempts[found["attempt_id"]])
            decision = self._decide(view, obs)
            pending.append(_Pending(index, obs, view, decision))
            evolved = _evolve(view, decision, now)
            tasks[found["id"]] = evolved
            attempts[found["attempt_id"]] = evolved.attempt
        return await self._write_batch(conn, pending)

    async def _write_batch(
        self, conn: asyncpg.Connection, pending: list[_Pending]
    ) -> list[ApplyResult]:
        """Audit rows first, one statement each, in the decided order; then every event in one
        ``write_events`` statement (the stream rows are locked last, for the shortest time).

        An attempt ends with the values of its last attempt change in the batch, from an event
        or an audit row: each event that records the attempt writes those final values.
        """
        final: dict[uuid.UUID, AttemptChange] = {}
        for item in pending:
            if item.locked is not None and item.decision.attempt is not None:
                final[item.locked.attempt.id] = item.decision.attempt
        results: list[ApplyResult | None] = [None] * len(pending)
        events: list[tuple[_Pending, NewEvent]] = []
        for item in pending:
            locked, decision = item.locked, item.decision
            if locked is None or decision.outcome is not Outcome.APPLIED:
                results[item.index] = await self._write(conn, item)
                continue
            assert decision.change is not None
            attempt_change = decision.attempt
            if attempt_change is not None:
                attempt_change = final[locked.attempt.id]
            events.append((item, _new_event(item, locked, decision.change, attempt_change)))
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

    def _decide(self, locked: _Locked | None, obs: Observation) -> Decision:
        if locked is None:
            return Decision(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT)
        return decide(locked.task, locked.attempt, obs, self.clock(), self.policy)

    async def _write(self, conn: asyncpg.Connection, item: _Pending) -> ApplyResult:
        """The decided observation's write: its event (applied) or its audit row."""
        obs, locked, decision = item.obs, item.locked, item.decision
        if locked is None:
            await self._record(conn, None, obs, decision)
            return ApplyResult(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT, None, None, None)
        task = locked.task
        if decision.outcome is not Outcome.APPLIED:
            await self._record(conn, locked, obs, decision)
            return ApplyResult(decision.outcome, decision.reason, task.id, task.version, None)
        assert decision.change is not None
        event = _new_event(item, locked, decision.change, decision.attempt)
        written = await write_event(conn, event.ref, **event.params())
        return ApplyResult(Outcome.APPLIED, decision.reason, task.id, written.version, written)

    @staticmethod
    def _count(obs: Observation, result: ApplyResult) -> ApplyResult:
        reason = str(result.reason) if result.reason is not None else ""
        OBSERVATIONS.labels(str(obs.source), str(result.outcome), reason).inc()
        return result

    async def _record(
        self,
        conn: asyncpg.Connection,
        locked: _Locked | None,
        obs: Observation,
        decision: Decision,
    ) -> None:
        provider = obs if isinstance(obs, ProviderObservation) else None
        change = decision.attempt
        detail = None
        if decision.reconcile is not None:
            detail = {
                "observed": _observed(obs),
                "task_status": str(locked.task.status) if locked is not None else None,
                "attempt_provider_status": _status_or_none(locked),
                "source": str(obs.source),
                "trace_id": obs.trace_id,
            }
        task_id = locked.task.id if locked is not None else None
        attempt_id = obs.attempt_id if locked is not None else None
        await conn.execute(
            q("record_unapplied"),
            task_id,
            attempt_id,
            locked.ref.project_id if locked is not None else None,
            str(decision.outcome),
            str(decision.reason),
            str(obs.source),
            provider.provider if provider else None,
            _observed(obs),
            provider.provider_sequence if provider else None,
            obs.progress,
            locked.task.version if locked is not None else None,
            provider.inbox_id if provider else None,
            provider.dedup_key if provider else None,
            obs.trace_id,
            obs.received_at,
            change is not None,
            str(change.provider_status) if change and change.provider_status else None,
            change.last_provider_seq if change else None,
            change.last_provider_at if change else None,
            str(decision.reconcile) if decision.reconcile is not None else None,
            detail,
        )


def _new_event(
    item: _Pending, locked: _Locked, change: TaskChange, attempt_change: AttemptChange | None
) -> NewEvent:
    obs = item.obs
    provider = obs if isinstance(obs, ProviderObservation) else None
    audit = None
    if not item.decision.public:  # a new version, but no public event: its audit row instead
        audit = AuditRow(
            reason=str(item.decision.reason),
            observed=_observed(obs),
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


def _status_or_none(locked: _Locked | None) -> str | None:
    if locked is None or locked.attempt.provider_status is None:
        return None
    return str(locked.attempt.provider_status)


def _occurred_at(obs: Observation) -> datetime:
    if isinstance(obs, ProviderObservation) and obs.provider_occurred_at is not None:
        return obs.provider_occurred_at
    return obs.received_at


__all__ = ["ApplyResult", "BatchPartlyFailed", "StateService"]
