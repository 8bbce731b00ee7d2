"""Task commands (create, cancel, retry) and reads (snapshot, list, audit).

Every change still goes through the state service's ``write_event`` or ``apply_in``; this module
adds what surrounds them: the idempotency key, the attempt rows, the snapshot's position-first read.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.public import public_error, stored_event
from aivedio.domain.statuses import CANCELABLE, RETRYABLE, STATUS_TABLE, Status
from aivedio.domain.transitions import RETRY_CHANGE, TaskChange
from aivedio.errors import Conflict, IdempotencyMismatch, NotFound
from aivedio.state.events import TaskRef, write_event
from aivedio.state.service import StateService


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant and the user behind an API key or session."""

    tenant_id: uuid.UUID
    user_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class NewTask:
    provider: str
    model: str
    prompt: str
    params: dict[str, Any]

    def request_hash(self) -> bytes:
        canonical = json.dumps(
            {
                "provider": self.provider,
                "model": self.model,
                "prompt": self.prompt,
                "params": self.params,
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )
        return hashlib.sha256(canonical.encode()).digest()


@dataclass(frozen=True, slots=True)
class Created:
    snapshot: dict[str, Any]
    replayed: bool  # the Idempotency-Key named an earlier, identical request


def new_client_request_id() -> str:
    """The id sent to the provider as idempotency key / metadata; unguessable."""
    return "cr_" + secrets.token_hex(16)


def cursor_of(epoch: int, seq: int) -> str:
    return f"{epoch}-{seq}"


def snapshot_of(row: asyncpg.Record | dict[str, Any], epoch: int, head: int) -> dict[str, Any]:
    """The public snapshot (DESIGN.md public contract)."""
    error = public_error(row["error_code"])
    if error is not None:
        error = {**error, "trace_id": row["trace_id"]}
    asset = None
    if row["asset_id"] is not None:
        # Not the file: an API path that checks the caller again and issues a short-lived link.
        playback = f"/v1/projects/{row['project_id']}/assets/{row['asset_id']}/playback"
        asset = {"id": str(row["asset_id"]), "playback_url": playback}
    return {
        "id": str(row["id"]),
        "project_id": str(row["project_id"]),
        "status": STATUS_TABLE[Status(row["status"])].public,
        "stage": row["stage"],
        "progress": row["progress"],
        "task_version": row["version"],
        "last_event_id": row["last_event_id"],
        "cursor": cursor_of(epoch, head),
        "error": error,
        "asset": asset,
        "created_at": row["created_at"].isoformat(),
        "updated_at": row["updated_at"].isoformat(),
    }


class TaskStore:
    def __init__(self, db: Database, state: StateService, idempotency_ttl: timedelta) -> None:
        self.db = db
        self.state = state
        self.idempotency_ttl = idempotency_ttl

    async def _require_project(
        self, conn: asyncpg.Connection, principal: Principal, project_id: uuid.UUID
    ) -> None:
        if await conn.fetchval(q("project_of_tenant"), project_id, principal.tenant_id) is None:
            raise NotFound("project")

    async def _lock_for(
        self,
        conn: asyncpg.Connection,
        principal: Principal,
        project_id: uuid.UUID,
        task_id: uuid.UUID,
        allowed: frozenset[Status],
        command: str,
    ) -> asyncpg.Record:
        """Lock the task for a command; 404 if it is not the caller's, 409 from a status where
        the command makes no sense (``not_cancelable`` / ``not_retryable``)."""
        await self._require_project(conn, principal, project_id)
        if await conn.fetchval(q("lock_task"), task_id, project_id) is None:
            raise NotFound("task")
        row = await conn.fetchrow(q("locked_task"), task_id)
        assert row is not None
        status = Status(row["status"])
        if status not in allowed:
            public = STATUS_TABLE[status].public
            raise Conflict(f"not_{command}able", f"{command} is not possible in status {public}")
        return row

    # -- commands -------------------------------------------------------------------------

    async def create(
        self,
        principal: Principal,
        project_id: uuid.UUID,
        idempotency_key: str,
        new: NewTask,
        trace_id: str | None,
    ) -> Created:
        """Create a task, its first attempt and version 1 in one transaction.

        The same key with the same body returns the same task; with another body it raises
        ``IdempotencyMismatch``. Two identical requests racing: the second waits on the key row
        and then reads the first one's task.
        """
        request_hash = new.request_hash()
        task_id, attempt_id = uuid.uuid4(), uuid.uuid4()
        async with self.db.transaction() as conn:
            await self._require_project(conn, principal, project_id)
            claimed = await conn.fetchval(
                q("claim_idempotency_key"),
                project_id,
                idempotency_key,
                request_hash,
                task_id,
                self.idempotency_ttl,
            )
            if claimed is not None:
                await self._insert(conn, principal, project_id, task_id, attempt_id, new, trace_id)
        if claimed is None:
            async with self.db.connection() as conn:
                existing = await conn.fetchrow(
                    q("get_idempotency_key"), project_id, idempotency_key
                )
            if existing is None:  # expired and removed between the two statements
                raise Conflict("idempotency_retry", "retry the request")
            if bytes(existing["request_hash"]) != request_hash:
                raise IdempotencyMismatch(idempotency_key)
            task_id = existing["task_id"]
        return Created(await self.snapshot(principal, project_id, task_id), claimed is None)

    async def _insert(
        self,
        conn: asyncpg.Connection,
        principal: Principal,
        project_id: uuid.UUID,
        task_id: uuid.UUID,
        attempt_id: uuid.UUID,
        new: NewTask,
        trace_id: str | None,
    ) -> None:
        await conn.execute(
            q("insert_task"),
            task_id,
            principal.tenant_id,
            project_id,
            principal.user_id,
            new.provider,
            new.model,
            new.prompt,
            new.params,
            attempt_id,
            trace_id,
        )
        await conn.execute(
            q("insert_attempt"),
            attempt_id,
            task_id,
            1,
            new.provider,
            new.model,
            new_client_request_id(),
            "create",
        )
        ref = TaskRef(task_id, project_id, principal.tenant_id, principal.user_id)
        await write_event(
            conn,
            ref,
            attempt_id=attempt_id,
            version=1,
            change=RETRY_CHANGE,
            source=str(Source.API),
            trace_id=trace_id,
            occurred_at=self.state.clock(),
        )

    async def cancel(
        self, principal: Principal, project_id: uuid.UUID, task_id: uuid.UUID, trace_id: str | None
    ) -> dict[str, Any]:
        """Ask for cancellation: ``cancel_requested`` until the provider confirms."""
        async with self.db.transaction() as conn:
            allowed = CANCELABLE | {Status.CANCEL_REQUESTED}  # asking again answers the same
            row = await self._lock_for(conn, principal, project_id, task_id, allowed, "cancel")
            if row["status"] != Status.CANCEL_REQUESTED:
                applied = await self.state.apply_in(
                    conn,
                    PlatformObservation(
                        kind=PlatformKind.CANCEL_REQUESTED,
                        attempt_id=row["attempt_id"],
                        source=Source.API,
                        trace_id=trace_id,
                    ),
                )
                if applied.event is not None:  # the cancel worker takes it from here
                    await conn.execute(
                        q("insert_cancel_intent"), row["attempt_id"], task_id, trace_id
                    )
        return await self.snapshot(principal, project_id, task_id)

    async def retry(
        self, principal: Principal, project_id: uuid.UUID, task_id: uuid.UUID, trace_id: str | None
    ) -> dict[str, Any]:
        """A new attempt for a failed or canceled task (see ``RETRYABLE``)."""
        async with self.db.transaction() as conn:
            row = await self._lock_for(conn, principal, project_id, task_id, RETRYABLE, "retry")
            attempt_no = await conn.fetchval(q("max_attempt_no"), task_id) + 1
            attempt_id = uuid.uuid4()
            await conn.execute(
                q("insert_attempt"),
                attempt_id,
                task_id,
                attempt_no,
                row["provider"],
                row["model"],
                new_client_request_id(),
                "retry",
            )
            await conn.execute(q("switch_attempt"), task_id, attempt_id)
            ref = TaskRef(task_id, project_id, row["tenant_id"], row["user_id"])
            change: TaskChange = RETRY_CHANGE
            await write_event(
                conn,
                ref,
                attempt_id=attempt_id,
                version=row["version"] + 1,
                change=change,
                source=str(Source.API),
                trace_id=trace_id,
                occurred_at=self.state.clock(),
            )
        return await self.snapshot(principal, project_id, task_id)

    # -- reads ----------------------------------------------------------------------------

    async def snapshot(
        self, principal: Principal, project_id: uuid.UUID, task_id: uuid.UUID
    ) -> dict[str, Any]:
        """Task and stream head in one REPEATABLE READ transaction (position-first snapshot)."""
        async with self.db.transaction(isolation="repeatable_read", readonly=True) as conn:
            await self._require_project(conn, principal, project_id)
            row = await conn.fetchrow(q("task_snapshot"), task_id, project_id)
        if row is None:
            raise NotFound("task")
        return snapshot_of(row, row["epoch"], row["head"])

    async def list(
        self,
        principal: Principal,
        project_id: uuid.UUID,
        limit: int,
        page: str | None,
    ) -> dict[str, Any]:
        after_at, after_id = decode_page(page) if page else (None, None)
        async with self.db.transaction(isolation="repeatable_read", readonly=True) as conn:
            await self._require_project(conn, principal, project_id)
            position = await conn.fetchrow(q("stream_position"), project_id)
            if position is None:
                raise NotFound("project")
            rows = await conn.fetch(q("list_tasks"), project_id, after_at, after_id, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        tasks = [snapshot_of(r, position["epoch"], position["head"]) for r in rows]
        next_page = encode_page(rows[-1]["created_at"], rows[-1]["id"]) if more else None
        return {
            "tasks": tasks,
            "next_page": next_page,
            "cursor": cursor_of(position["epoch"], position["head"]),
        }

    async def audit(
        self, principal: Principal, project_id: uuid.UUID, task_id: uuid.UUID
    ) -> dict[str, Any]:
        async with self.db.transaction(isolation="repeatable_read", readonly=True) as conn:
            await self._require_project(conn, principal, project_id)
            if await conn.fetchrow(q("task_snapshot"), task_id, project_id) is None:
                raise NotFound("task")
            events = await conn.fetch(q("task_events_of_task"), task_id)
            audit = await conn.fetch(q("audit_of_task"), task_id)
        return {
            "events": [
                {
                    "event_id": e["seq"],
                    "cursor": cursor_of(e["epoch"], e["seq"]),
                    "task_version": e["task_version"],
                    "type": e["event_type"],
                    "source": e["source"],
                    "trace_id": e["trace_id"],
                    "created_at": e["created_at"].isoformat(),
                    "payload": stored_event(
                        e["public_payload"], task_id, e["task_version"], e["seq"]
                    ),
                }
                for e in events
            ],
            "ignored_observations": [_audited(a) for a in audit if a["outcome"] != "applied"],
            # versions that changed no public field: written and audited, but no event
            "unpublished_versions": [_audited(a) for a in audit if a["outcome"] == "applied"],
        }

    async def events(
        self, principal: Principal, project_id: uuid.UUID, task_id: uuid.UUID
    ) -> dict[str, Any]:
        """The task's public events in seq order, each with the public fields it changed."""
        async with self.db.transaction(isolation="repeatable_read", readonly=True) as conn:
            await self._require_project(conn, principal, project_id)
            if await conn.fetchrow(q("task_snapshot"), task_id, project_id) is None:
                raise NotFound("task")
            rows = await conn.fetch(q("task_events_of_task"), task_id)
        timeline: list[dict[str, Any]] = []
        previous: dict[str, Any] = {}
        for e in sorted(rows, key=lambda r: r["seq"]):
            payload = stored_event(e["public_payload"], task_id, e["task_version"], e["seq"])
            timeline.append(
                {
                    "event_id": e["seq"],
                    "cursor": cursor_of(e["epoch"], e["seq"]),
                    "task_version": e["task_version"],
                    "created_at": e["created_at"].isoformat(),
                    "changed": changed_fields(previous, payload),
                    "payload": payload,
                }
            )
            previous = payload
        return {"events": timeline}


PUBLIC_FIELDS = ("status", "stage", "progress", "asset_id", "error")


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The public fields whose value differs between two payloads (all the set ones for the
    first event of a task, ``before`` = ``{}``)."""
    return [f for f in PUBLIC_FIELDS if before.get(f) != after.get(f)]


def _audited(a: asyncpg.Record) -> dict[str, Any]:
    return {
        "outcome": a["outcome"],
        "reason": a["reason"],
        "source": a["source"],
        "observed": a["observed"],
        "provider_sequence": a["provider_sequence"],
        "progress": a["progress"],
        "task_version": a["task_version"],
        "trace_id": a["trace_id"],
        "received_at": a["received_at"].isoformat(),
    }


def encode_page(created_at: datetime, task_id: uuid.UUID) -> str:
    raw = f"{created_at.isoformat()}|{task_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page(page: str) -> tuple[datetime, uuid.UUID]:
    """Raises ``ValueError`` for a page token that this server did not issue."""
    try:
        raw = base64.urlsafe_b64decode(page + "=" * (-len(page) % 4)).decode()
        at, _, tid = raw.partition("|")
        return datetime.fromisoformat(at), uuid.UUID(tid)
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise ValueError("invalid page token") from exc
