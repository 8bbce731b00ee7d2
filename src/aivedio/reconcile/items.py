"""The operator's reconciliation queue: ``aivedio reconcile list|resolve``.

Items are opened by the state service (contradictory terminals, a success of a stale attempt)
and by the reconciler (unknown submits not found, jobs the provider no longer knows). Resolving
one records who decided what; it never changes a task by itself (``aivedio tasks resubmit`` is
the separate, audited action that does).
"""

from __future__ import annotations

from typing import Any

import asyncpg

from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.errors import Conflict, NotFound

STATES: frozenset[str] = frozenset({"open", "resolved"})


def _item(row: asyncpg.Record) -> dict[str, Any]:
    return {
        "id": row["id"],
        "kind": row["kind"],
        "state": row["state"],
        "task_id": str(row["task_id"]),
        "attempt_id": str(row["attempt_id"]),
        "project_id": str(row["project_id"]),
        "task_status": row["task_status"],
        "provider": row["provider"],
        "provider_task_id": row["provider_task_id"],
        "client_request_id": row["client_request_id"],
        "detail": row["detail"],
        "resolution": row["resolution"],
        "resolved_by": row["resolved_by"],
        "created_at": row["created_at"].isoformat(),
        "resolved_at": row["resolved_at"].isoformat() if row["resolved_at"] else None,
    }


async def list_items(
    db: Database, state: str | None = "open", limit: int = 100
) -> list[dict[str, Any]]:
    """Items in ``state`` (``open``, ``resolved``, or None for all), oldest first."""
    if state is not None and state not in STATES:
        raise ValueError(f"state must be one of {sorted(STATES)} or None")
    async with db.connection() as conn:
        rows = await conn.fetch(q("list_items"), state, limit)
    return [_item(r) for r in rows]


async def resolve_item(
    db: Database, item_id: int, resolution: str, operator: str
) -> dict[str, Any]:
    """Close an open item with the operator's resolution. ``NotFound`` for an unknown id,
    ``Conflict("already_resolved", ...)`` for an item that is not open."""
    resolution, operator = resolution.strip(), operator.strip()
    if not resolution or not operator:
        raise ValueError("a resolution and an operator are required")
    async with db.transaction() as conn:
        row = await conn.fetchrow(q("resolve_item"), item_id, resolution, operator)
        if row is None:
            if await conn.fetchval(q("item_state"), item_id) is None:
                raise NotFound("reconciliation item")
            raise Conflict("already_resolved", f"item {item_id} is already resolved")
    return {
        "id": row["id"],
        "kind": row["kind"],
        "task_id": str(row["task_id"]),
        "attempt_id": str(row["attempt_id"]),
        "state": row["state"],
        "resolution": row["resolution"],
        "resolved_by": row["resolved_by"],
        "resolved_at": row["resolved_at"].isoformat(),
    }
