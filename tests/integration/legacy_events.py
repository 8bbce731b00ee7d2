"""Tasks and events written the way aivedio wrote them before migration 0016: for the tests
that convert an older database (today's code writes the slim rows, which an older schema does
not take).

Each task gets ``per_task`` events of its project's stream, as the old ``write_event`` stored
them: tenant, attempt, ``event_type``, ``occurred_at`` columns, the payload as JSONB without
identity fields and nulls (the oldest rows kept their ``task_id`` and ``task_version``: one of
them here), the trace id as text. The task row ends at its last event.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from aivedio.db.migrate import migrate
from tests.conftest import with_database
from tests.integration.helpers import Project

__all__ = ["OLD_EVENT", "database_at", "write_old_tasks"]


@contextlib.asynccontextmanager
async def database_at(admin_database_url: str, version: int) -> AsyncIterator[str]:
    """A new, empty database migrated up to ``version`` only; its URL. Dropped afterwards."""
    name = f"aivedio_old_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = with_database(admin_database_url, name)
        conn = await asyncpg.connect(url)
        try:
            applied = await migrate(conn, upto=version)
            assert applied[-1] == version
        finally:
            await conn.close()
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


OLD_EVENT = """
WITH stream AS (
    UPDATE event_streams SET head = head + 1 WHERE project_id = $1 RETURNING epoch, head
)
INSERT INTO task_events (project_id, epoch, seq, tenant_id, task_id, attempt_id, task_version,
                         event_type, public_payload, source, trace_id, occurred_at, created_at)
SELECT $1, epoch, head, $2, $3, NULL, $4, 'task.status', $5::text::jsonb, $6, $7, now(),
       clock_timestamp()
FROM stream
"""


def _payload(task_id: uuid.UUID, version: int, step: int) -> dict[str, Any]:
    if step == 0:  # the oldest rows kept their identity fields
        identity = {"task_id": str(task_id), "task_version": version}
        return {**identity, "status": "queued", "stage": "submitting"}
    if step == 3:
        error = {"code": "timeout", "message": "The video took too long to generate."}
        return {"status": "failed", "stage": "failed", "progress": 60, "error": error}
    return {"status": "running", "stage": "generating", "progress": 20 * step}


def _trace(task_no: int, step: int) -> str | None:
    if step == 1:
        return None
    if step == 2:  # a traceparent's trace id
        return f"trc_{uuid.UUID(int=task_no * 7 + step).hex}"
    return f"trc_{uuid.UUID(int=task_no * 7 + step).hex[:24]}"  # aivedio's own (12 bytes)


async def write_old_tasks(
    conn: asyncpg.Connection, project: Project, tasks: int, per_task: int = 4
) -> list[uuid.UUID]:
    """``tasks`` tasks with ``per_task`` events each (at most 4); their ids."""
    ids = []
    for task_no in range(tasks):
        task_id = uuid.uuid4()
        await conn.execute(
            """INSERT INTO generation_tasks (id, tenant_id, project_id, user_id, provider, model,
                   prompt, status, stage, version)
               VALUES ($1, $2, $3, $4, 'sandbox', 'm1', 'a cat', 'running', 'generating', 0)""",
            task_id,
            project.tenant_id,
            project.project_id,
            project.principal.user_id,
        )
        for step in range(per_task):
            version = step + 1
            payload = _payload(task_id, version, step)
            await conn.execute(
                OLD_EVENT,
                project.project_id,
                project.tenant_id,
                task_id,
                version,
                json.dumps(payload),
                "api" if step == 0 else "webhook",
                _trace(task_no, step),
            )
            await conn.execute(
                """UPDATE generation_tasks
                   SET status = $2, stage = $3, progress = $4, version = $5, error_code = $6,
                       last_event_id = (SELECT head FROM event_streams WHERE project_id = $7)
                   WHERE id = $1""",
                task_id,
                "failed" if step == 3 else "created" if step == 0 else "running",
                payload["stage"],
                payload.get("progress"),
                version,
                "timeout" if step == 3 else None,
                project.project_id,
            )
        ids.append(task_id)
    return ids
