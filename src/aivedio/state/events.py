"""Writing task versions: the event, its stream seq, the task row, the attempt, the outbox row.

``write_event`` writes one version in one statement; ``write_events`` writes many in one
statement (``apply_many``). The caller holds the task locks (or created the task in the same
transaction). The public payload is built from the whitelist in ``domain.public``; the outbox
payload is the bus event of seed §12.5.5.

A version that changes no public field (``Reason.NO_PUBLIC_CHANGE``: the event carries an
``audit`` row) takes no stream seq and writes no task event: the task row, the attempt and the
outbox row (its ``public``, ``event_id`` and ``epoch`` null: the dispatcher skips it, internal
consumers read it) as usual, and the ``observation_audit`` row (outcome ``applied``) instead of
the event.

The outbox row's ``event_type`` is its routing class (the relay maps it to a bus topic):
``task.progress.changed`` for a version that moves only the progress
(``domain.transitions.progress_only``), ``task.status.changed`` for every other. The bus event
itself says ``task.status.changed`` either way: a consumer reads both the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import orjson

from aivedio.db.queries import q
from aivedio.domain.public import public_event, stored_fields
from aivedio.domain.statuses import STATUS_TABLE
from aivedio.domain.transitions import AttemptChange, TaskChange

STATUS_CHANGED = "task.status.changed"
"""The bus event's type, and the outbox routing class of every version but a progress one."""
PROGRESS_CHANGED = "task.progress.changed"
"""The outbox routing class of a version that moves only the progress."""


@dataclass(frozen=True, slots=True)
class EventWritten:
    """A new task version; ``epoch`` and ``seq`` are None when it is not a public event."""

    epoch: int | None
    seq: int | None
    version: int

    @property
    def public(self) -> bool:
        return self.seq is not None


@dataclass(frozen=True, slots=True)
class AuditRow:
    """The ``observation_audit`` row written for a version that is not a public event."""

    reason: str
    observed: str
    received_at: datetime
    provider: str | None = None
    provider_sequence: int | None = None
    progress: int | None = None
    dedup_key: str | None = None


@dataclass(frozen=True, slots=True)
class TaskRef:
    """Who a task belongs to: what every event row carries."""

    task_id: uuid.UUID
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    user_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class NewEvent:
    """One new task version to write: ``write_event``'s arguments, ``write_events``' element."""

    ref: TaskRef
    attempt_id: uuid.UUID | None
    version: int
    change: TaskChange
    source: str
    trace_id: str | None
    occurred_at: datetime
    attempt_change: AttemptChange | None = None
    inbox_id: int | None = None
    audit: AuditRow | None = None  # set: not a public event (no seq), this audit row instead
    event_type: str = STATUS_CHANGED  # the outbox row's routing class

    def params(self) -> dict[str, Any]:
        """``write_event``'s keyword arguments."""
        return {
            "attempt_id": self.attempt_id,
            "version": self.version,
            "change": self.change,
            "source": self.source,
            "trace_id": self.trace_id,
            "occurred_at": self.occurred_at,
            "attempt_change": self.attempt_change,
            "inbox_id": self.inbox_id,
            "audit": self.audit,
            "event_type": self.event_type,
        }


def domain_payload(
    ref: TaskRef,
    *,
    attempt_id: uuid.UUID | None,
    version: int,
    change: TaskChange,
    source: str,
    trace_id: str | None,
    occurred_at: datetime,
    public: dict[str, Any] | None,
) -> dict[str, Any]:
    """The bus event (seed §12.5.5); internal consumers read ``status`` (the internal one).
    ``public`` is None for a version that is not a public event."""
    return {
        "event_type": STATUS_CHANGED,
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


def stored_payload(public: dict[str, Any]) -> str:
    """A public event as its ``task_events`` row stores it (``domain.public.stored_fields``):
    compact JSON, which the replay sends on as it reads it (orjson: a third of the cost of
    ``json.dumps`` per event written)."""
    return orjson.dumps(stored_fields(public)).decode()


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
    audit: AuditRow | None = None,
    event_type: str = STATUS_CHANGED,
) -> EventWritten:
    """Write one new task version: stream seq, task event, task row, attempt, outbox, inbox;
    with ``audit``, no seq and no task event but that audit row (not a public event).

    The caller holds the task lock (or created the task in this transaction).
    """
    public, payload = _payloads(
        ref, attempt_id, version, change, source, trace_id, occurred_at, audit is None
    )
    a = audit
    row = await conn.fetchrow(
        q("write_event"),
        ref.project_id,
        ref.task_id,
        attempt_id,
        version,
        stored_payload(public) if public is not None else None,
        source,
        trace_id,
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
        a is None,
        a.reason if a else None,
        a.observed if a else None,
        a.received_at if a else None,
        a.provider if a else None,
        a.provider_sequence if a else None,
        a.progress if a else None,
        a.dedup_key if a else None,
        event_type,
    )
    assert row is not None  # one row, always
    return _written(row, ref, version, public=a is None)


def _written(row: asyncpg.Record, ref: TaskRef, version: int, *, public: bool) -> EventWritten:
    """Check the ``write_event`` statement's row: the stream exists, the task moved one version."""
    if public and row["head"] is None:
        raise RuntimeError(f"project {ref.project_id} has no event stream")
    if row["tasks_updated"] != 1:
        raise RuntimeError(f"task {ref.task_id} is not at version {version - 1}")
    return EventWritten(epoch=row["epoch"], seq=row["head"], version=version)


def _payloads(
    ref: TaskRef,
    attempt_id: uuid.UUID | None,
    version: int,
    change: TaskChange,
    source: str,
    trace_id: str | None,
    occurred_at: datetime,
    is_public: bool = True,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The public event payload (None: not a public event) and the bus (outbox) payload of one
    new version."""
    public = None
    if is_public:
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
    return public, payload


async def write_events(conn: asyncpg.Connection, events: Sequence[NewEvent]) -> list[EventWritten]:
    """``write_event`` for many events in one statement (``write_events`` in ``state.sql``).

    ``events`` come in write order: grouped by project, in the order they were decided within
    a project (their stream seqs follow that order; events with an ``audit`` row take none). A
    task's events have consecutive versions; an attempt's events carry its final values. The
    caller holds the task locks.
    """
    if not events:
        return []
    rows = await conn.fetch(q("write_events"), *_columns(events))
    if len(rows) != len(events) or any(
        e.audit is None and row["seq"] is None for row, e in zip(rows, events, strict=True)
    ):
        raise RuntimeError("a project of the batch has no event stream")
    if rows[0]["tasks_updated"] != rows[0]["tasks"]:
        raise RuntimeError("a task of the batch is not at the version it was decided on")
    return [
        EventWritten(epoch=row["epoch"], seq=row["seq"], version=e.version)
        for row, e in zip(rows, events, strict=True)
    ]


def _columns(events: Sequence[NewEvent]) -> list[list[Any]]:
    """The ``write_events`` statement's 29 array arguments, one element per event."""
    columns: list[list[Any]] = [[] for _ in range(29)]
    for e in events:
        public, payload = _payloads(
            e.ref,
            e.attempt_id,
            e.version,
            e.change,
            e.source,
            e.trace_id,
            e.occurred_at,
            e.audit is None,
        )
        a, audit = e.attempt_change, e.audit
        values = (
            e.ref.project_id,
            e.ref.task_id,
            e.attempt_id,
            e.version,
            stored_payload(public) if public is not None else None,
            e.source,
            e.trace_id,
            str(e.change.status),
            str(e.change.stage),
            e.change.progress,
            e.change.error_code,
            e.change.error_message,
            e.change.asset_id,
            e.change.terminal,
            orjson.dumps(payload).decode(),
            a is not None,
            str(a.provider_status) if a and a.provider_status else None,
            a.last_provider_seq if a else None,
            a.last_provider_at if a else None,
            e.inbox_id,
            audit is None,
            audit.reason if audit else None,
            audit.observed if audit else None,
            audit.received_at if audit else None,
            audit.provider if audit else None,
            audit.provider_sequence if audit else None,
            audit.progress if audit else None,
            audit.dedup_key if audit else None,
            e.event_type,
        )
        for column, value in zip(columns, values, strict=True):
            column.append(value)
    return columns
