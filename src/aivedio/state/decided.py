"""A batch's decided observations as the state service writes them: the locked task each one
saw (its row, or its state evolved in memory by the observations before it in the batch), and the
audit rows of those that changed nothing (``record_unapplied``, one statement for a batch).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import asyncpg

from aivedio.db.queries import q
from aivedio.domain.observation import Observation, ProviderObservation, ProviderStatus
from aivedio.domain.statuses import Stage, Status
from aivedio.domain.transitions import AttemptView, Decision, Outcome, TaskView
from aivedio.state.events import TaskRef

__all__ = [
    "NO_PROJECT",
    "Locked",
    "Pending",
    "attempt_view",
    "evolve",
    "locked_from",
    "observed",
    "record_unapplied",
    "status_or_none",
    "task_view",
]


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
class Locked:
    """A locked task as the next observation sees it: the row, or its state evolved in memory
    by the observations before it in the same batch."""

    ref: TaskRef
    task: TaskView
    attempt: AttemptView


def locked_from(row: asyncpg.Record) -> Locked:
    attempt = attempt_view(row)
    assert attempt is not None  # lock_task(s)_for_attempt(s) start from the attempt
    ref = TaskRef(row["id"], row["project_id"], row["tenant_id"], row["user_id"])
    return Locked(ref, task_view(row), attempt)


def evolve(locked: Locked, decision: Decision, now: datetime) -> Locked:
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
    return Locked(locked.ref, task, attempt)


@dataclass(frozen=True, slots=True)
class Pending:
    """One decided observation of a batch, waiting for its write."""

    index: int
    obs: Observation
    locked: Locked | None  # before the decision; None: unknown attempt
    decision: Decision

    @property
    def order(self) -> uuid.UUID:
        """Writes go in project order (stream row locks in one order across batches)."""
        return self.locked.ref.project_id if self.locked is not None else NO_PROJECT


NO_PROJECT = uuid.UUID(int=0)


def observed(obs: Observation) -> str:
    if isinstance(obs, ProviderObservation):
        return str(obs.status)
    if obs.stage is not None:
        return f"{obs.kind}:{obs.stage}"
    return str(obs.kind)


async def record_unapplied(conn: asyncpg.Connection, items: Sequence[Pending]) -> None:
    """The audit rows of observations that changed nothing, in decided order: ONE
    ``record_unapplied`` statement for all of them (a batch's stale rows took a round trip
    each)."""
    rows = [_audit_values(item) for item in items]
    await conn.execute(q("record_unapplied"), *(list(column) for column in zip(*rows, strict=True)))


def _audit_values(item: Pending) -> tuple[object, ...]:
    """One observation's elements of ``record_unapplied``'s 21 arrays."""
    obs, locked, decision = item.obs, item.locked, item.decision
    provider = obs if isinstance(obs, ProviderObservation) else None
    change = decision.attempt
    detail = None
    if decision.reconcile is not None:
        detail = json.dumps(
            {
                "observed": observed(obs),
                "task_status": str(locked.task.status) if locked is not None else None,
                "attempt_provider_status": status_or_none(locked),
                "source": str(obs.source),
                "trace_id": obs.trace_id,
            }
        )
    return (
        locked.task.id if locked is not None else None,
        obs.attempt_id if locked is not None else None,
        locked.ref.project_id if locked is not None else None,
        str(decision.outcome),
        str(decision.reason),
        str(obs.source),
        provider.provider if provider else None,
        observed(obs),
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


def status_or_none(locked: Locked | None) -> str | None:
    if locked is None or locked.attempt.provider_status is None:
        return None
    return str(locked.attempt.provider_status)
