"""``aivedio tasks resubmit ID --reason ...``: the only way to a second generation of one task.

Neither the submitter, the poller nor the reconciler ever create an attempt. When a submit's
outcome stays unknown (or a task's status does, or the reconciler flagged its attempt), an
operator decides, and this command records the decision: a new attempt with a new
``client_request_id`` and its submit intent, the reason on the attempt, the operator's resolution
of every open reconciliation item of the old attempt plus a ``resubmit`` item born resolved (the
audit trail), and a new task version (``created``), all in one transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import Source
from aivedio.domain.statuses import STATUS_TABLE, Stage, Status
from aivedio.domain.transitions import RETRY_CHANGE, Reason, TaskChange, changes_public
from aivedio.errors import Conflict, NotFound
from aivedio.state.events import AuditRow, TaskRef, write_event
from aivedio.state.tasks import new_client_request_id

# Statuses whose provider-side truth is unknown: resubmitting them is an operator's call.
RESUBMITTABLE: frozenset[Status] = frozenset({Status.SUBMIT_UNKNOWN, Status.STATUS_UNKNOWN})
# Never resubmitted, flagged or not: the provider's result exists (it was paid for) or the task
# is finished or being canceled. A failed / canceled task is retried by its user instead.
_NEVER: frozenset[Status] = frozenset(
    {
        Status.CANCEL_REQUESTED,
        Status.PROVIDER_SUCCEEDED,
        Status.PROCESSING_MEDIA,
        Status.READY,
        Status.FAILED,
        Status.CANCELED,
    }
)


@dataclass(frozen=True, slots=True)
class Resubmitted:
    task_id: uuid.UUID
    previous_attempt_id: uuid.UUID
    attempt_id: uuid.UUID
    attempt_no: int
    client_request_id: str
    task_version: int
    resolved_items: tuple[int, ...]
    audit_item_id: int

    def as_dict(self) -> dict[str, object]:
        return {
            "task_id": str(self.task_id),
            "previous_attempt_id": str(self.previous_attempt_id),
            "attempt_id": str(self.attempt_id),
            "attempt_no": self.attempt_no,
            "client_request_id": self.client_request_id,
            "task_version": self.task_version,
            "resolved_items": list(self.resolved_items),
            "audit_item_id": self.audit_item_id,
        }


async def resubmit(db: Database, task_id: uuid.UUID, reason: str, operator: str) -> Resubmitted:
    """Create a new attempt for a task whose outcome is unknown or that the reconciler flagged.

    Raises ``ValueError`` for an empty reason or operator, ``NotFound`` for an unknown task and
    ``Conflict("not_resubmittable", ...)`` for a healthy, finished or canceling task."""
    reason, operator = reason.strip(), operator.strip()
    if not reason or not operator:
        raise ValueError("a resubmit needs a reason and an operator")
    async with db.transaction() as conn:
        row = await _lock_resubmittable(conn, task_id)
        status = Status(row["status"])
        old_attempt: uuid.UUID = row["attempt_id"]
        attempt_no = await conn.fetchval(q("max_attempt_no"), task_id) + 1
        attempt_id = uuid.uuid4()
        client_request_id = new_client_request_id()
        await conn.execute(
            q("insert_attempt"),
            attempt_id,
            task_id,
            attempt_no,
            row["provider"],
            row["model"],
            client_request_id,
            f"resubmit by {operator}: {reason}",
        )
        resolution = f"resubmitted as attempt {attempt_no}: {reason}"
        resolved = await conn.fetch(
            q("resolve_items_of_attempt"), old_attempt, resolution, operator
        )
        audit_id = await conn.fetchval(
            q("insert_resolved_item"),
            "resubmit",
            task_id,
            old_attempt,
            row["project_id"],
            {
                "reason": reason,
                "operator": operator,
                "previous_status": str(status),
                "previous_attempt_id": str(old_attempt),
                "new_attempt_id": str(attempt_id),
                "resolved_items": [r["id"] for r in resolved],
            },
            resolution,
            operator,
        )
        await conn.execute(q("switch_attempt"), task_id, attempt_id)
        version = await _write_retry(conn, task_id, row, attempt_id)
    return Resubmitted(
        task_id=task_id,
        previous_attempt_id=old_attempt,
        attempt_id=attempt_id,
        attempt_no=attempt_no,
        client_request_id=client_request_id,
        task_version=version,
        resolved_items=tuple(r["id"] for r in resolved),
        audit_item_id=audit_id,
    )


async def _lock_resubmittable(conn: asyncpg.Connection, task_id: uuid.UUID) -> asyncpg.Record:
    """Lock the task's row; ``NotFound`` or ``Conflict`` unless it may be resubmitted."""
    row = await conn.fetchrow(q("lock_task_by_id"), task_id)
    if row is None:
        raise NotFound("task")
    status = Status(row["status"])
    flagged = await conn.fetch(q("open_items_of_attempt"), row["attempt_id"])
    if status in _NEVER or (status not in RESUBMITTABLE and not flagged):
        raise Conflict(
            "not_resubmittable",
            f"a task in status {status} with no open reconciliation item is not resubmitted"
            f" (public status {STATUS_TABLE[status].public})",
        )
    return row


async def _write_retry(
    conn: asyncpg.Connection, task_id: uuid.UUID, row: asyncpg.Record, attempt_id: uuid.UUID
) -> int:
    """The task's new version (``created``) on the new attempt; the version written."""
    status = Status(row["status"])
    now = datetime.now(UTC)
    shown = TaskChange(
        status, Stage(row["stage"]), row["progress"], row["error_code"], None, row["asset_id"]
    )
    audit = None  # submit_unknown -> created looks the same: a version, not a public event
    if not changes_public(shown, RETRY_CHANGE):
        audit = AuditRow(str(Reason.NO_PUBLIC_CHANGE), "resubmit", now)
    written = await write_event(
        conn,
        TaskRef(task_id, row["project_id"], row["tenant_id"], row["user_id"]),
        attempt_id=attempt_id,
        version=row["version"] + 1,
        change=RETRY_CHANGE,
        source=str(Source.RECONCILE),
        trace_id=None,
        occurred_at=now,
        audit=audit,
    )
    return written.version
