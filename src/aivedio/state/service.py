"""``apply_observation``: webhook, poll, reconcile, submit and media paths all call exactly this.

One transaction: lock the task (the aggregate lock), decide with the pure core, and either write
version + 1 with its stream seq, task event and outbox row (``write_event``), or record why
nothing changed (``record_unapplied``). All or nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
from prometheus_client import Counter, Histogram

from aivedio.config import StateConfig
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import (
    Observation,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
)
from aivedio.domain.public import public_event
from aivedio.domain.statuses import STATUS_TABLE, Stage, Status
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
)

OBSERVATIONS = Counter(
    "aivedio_observations_total",
    "Observations given to the state service, by source, outcome and reason",
    ["source", "outcome", "reason"],
)
APPLY_SECONDS = Histogram(
    "aivedio_apply_observation_seconds",
    "Time to apply one observation, transaction included",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)


@dataclass(frozen=True, slots=True)
class EventWritten:
    epoch: int
    seq: int
    version: int


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: Outcome
    reason: Reason | None
    task_id: uuid.UUID | None
    task_version: int | None  # the version after this observation
    event: EventWritten | None


@dataclass(frozen=True, slots=True)
class TaskRef:
    """Who a task belongs to: what every event row carries."""

    task_id: uuid.UUID
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    user_id: uuid.UUID


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
            result = await self.apply_in(conn, obs)
        APPLY_SECONDS.observe(time.perf_counter() - started)
        return result

    async def apply_in(self, conn: asyncpg.Connection, obs: Observation) -> ApplyResult:
        """Apply one observation inside the caller's transaction."""
        row = None
        if obs.attempt_id is not None:
            row = await conn.fetchrow(q("lock_task_for_attempt"), obs.attempt_id)
        if row is None:
            await self._record(conn, None, obs, Decision(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT))
            return self._count(
                obs, ApplyResult(Outcome.IGNORED, Reason.UNKNOWN_ATTEMPT, None, None, None)
            )
        task = task_view(row)
        decision = decide(task, attempt_view(row), obs, self.clock(), self.policy)
        if decision.outcome is not Outcome.APPLIED:
            await self._record(conn, row, obs, decision)
            return self._count(
                obs, ApplyResult(decision.outcome, decision.reason, task.id, task.version, None)
            )
        assert decision.change is not None
        ref = TaskRef(row["id"], row["project_id"], row["tenant_id"], row["user_id"])
        written = await write_event(
            conn,
            ref,
            attempt_id=row["attempt_id"],
            version=task.version + 1,
            change=decision.change,
            source=str(obs.source),
            trace_id=obs.trace_id,
            occurred_at=_occurred_at(obs),
            attempt_change=decision.attempt,
            inbox_id=obs.inbox_id if isinstance(obs, ProviderObservation) else None,
        )
        return self._count(
            obs, ApplyResult(Outcome.APPLIED, None, task.id, written.version, written)
        )

    @staticmethod
    def _count(obs: Observation, result: ApplyResult) -> ApplyResult:
        reason = str(result.reason) if result.reason is not None else ""
        OBSERVATIONS.labels(str(obs.source), str(result.outcome), reason).inc()
        return result

    async def _record(
        self,
        conn: asyncpg.Connection,
        row: asyncpg.Record | None,
        obs: Observation,
        decision: Decision,
    ) -> None:
        provider = obs if isinstance(obs, ProviderObservation) else None
        change = decision.attempt
        detail = None
        if decision.reconcile is not None:
            detail = {
                "observed": _observed(obs),
                "task_status": row["status"] if row is not None else None,
                "attempt_provider_status": row["provider_status"] if row is not None else None,
                "source": str(obs.source),
                "trace_id": obs.trace_id,
            }
        task_id = row["id"] if row is not None else None
        attempt_id = obs.attempt_id if row is not None else None
        await conn.execute(
            q("record_unapplied"),
            task_id,
            attempt_id,
            row["project_id"] if row is not None else None,
            str(decision.outcome),
            str(decision.reason),
            str(obs.source),
            provider.provider if provider else None,
            _observed(obs),
            provider.provider_sequence if provider else None,
            obs.progress,
            row["version"] if row is not None else None,
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


def _occurred_at(obs: Observation) -> datetime:
    if isinstance(obs, ProviderObservation) and obs.provider_occurred_at is not None:
        return obs.provider_occurred_at
    return obs.received_at


def domain_payload(
    ref: TaskRef,
    *,
    attempt_id: uuid.UUID | None,
    version: int,
    change: TaskChange,
    source: str,
    trace_id: str | None,
    occurred_at: datetime,
    public: dict[str, Any],
) -> dict[str, Any]:
    """The bus event (seed §12.5.5); internal consumers read ``status`` (the internal one)."""
    return {
        "event_type": "task.status.changed",
        "aggregate_id": str(ref.task_id),
        "aggregate_version": version,
        "tenant_id": str(ref.tenant_id),
        "project_id": str(ref.project_id),
        "user_id": str(ref.user_id),
        "attempt_id": str(attempt_id) if attempt_id is not None else None,
        "status": str(change.status),
        "public_status": STATUS_TABLE[change.status].public,
        "stage": str(change.stage),
        "progress": change.progress,
        "terminal": change.terminal,
        "asset_id": str(change.asset_id) if change.asset_id is not None else None,
        "error_code": change.error_code,
        "source": source,
        "occurred_at": occurred_at.isoformat(),
        "trace_id": trace_id,
        "public": public,
    }


async def write_event(
    conn: asyncpg.Connection,
    ref: TaskRef,
    *,
    attempt_id: uuid.UUID | None,
    version: int,
    change: TaskChange,
    source: str,
    trace_id: str | None,
    occurred_at: datetime,
    attempt_change: AttemptChange | None = None,
    inbox_id: int | None = None,
) -> EventWritten:
    """Write one new task version: stream seq, task event, task row, attempt, outbox, inbox.

    The caller holds the task lock (or created the task in this transaction).
    """
    public = public_event(
        task_id=ref.task_id,
        task_version=version,
        status=change.status,
        stage=str(change.stage),
        progress=change.progress,
        asset_id=change.asset_id,
        error_code=change.error_code,
    )
    payload = domain_payload(
        ref,
        attempt_id=attempt_id,
        version=version,
        change=change,
        source=source,
        trace_id=trace_id,
        occurred_at=occurred_at,
        public=public,
    )
    row = await conn.fetchrow(
        q("write_event"),
        ref.project_id,
        ref.tenant_id,
        ref.task_id,
        attempt_id,
        version,
        public,
        source,
        trace_id,
        occurred_at,
        str(change.status),
        str(change.stage),
        change.progress,
        change.error_code,
        change.error_message,
        change.asset_id,
        change.terminal,
        payload,
        attempt_change is not None,
        str(attempt_change.provider_status)
        if attempt_change and attempt_change.provider_status
        else None,
        attempt_change.last_provider_seq if attempt_change else None,
        attempt_change.last_provider_at if attempt_change else None,
        inbox_id,
    )
    if row is None:
        raise RuntimeError(f"project {ref.project_id} has no event stream")
    if row["tasks_updated"] != 1:
        raise RuntimeError(f"task {ref.task_id} is not at version {version - 1}")
    return EventWritten(epoch=row["epoch"], seq=row["head"], version=version)


__all__ = [
    "ApplyResult",
    "EventWritten",
    "PlatformObservation",
    "StateService",
    "TaskRef",
    "write_event",
]
