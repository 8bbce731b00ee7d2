"""Test helpers that create real rows through the real code paths."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aivedio.admin import create_project_in
from aivedio.db.pool import Database
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore


@dataclass(frozen=True)
class Project:
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    principal: Principal
    api_key: str


async def make_project(db: Database, tenant: str = "acme", project: str = "web") -> Project:
    async with db.connection() as conn:
        made = await create_project_in(conn, tenant, project)
    tenant_id = uuid.UUID(made["tenant_id"])
    return Project(
        tenant_id=tenant_id,
        project_id=uuid.UUID(made["project_id"]),
        principal=Principal(tenant_id, uuid.UUID(made["user_id"])),
        api_key=made["api_key"],
    )


def store(db: Database, state: StateService | None = None) -> TaskStore:
    return TaskStore(db, state or StateService(db), timedelta(hours=1))


async def make_task(
    tasks: TaskStore,
    project: Project,
    key: str | None = None,
    trace_id: str | None = None,
    **overrides: Any,
) -> tuple[uuid.UUID, uuid.UUID]:
    """Create a task through the store (under ``trace_id``, when given); return (task id,
    current attempt id)."""
    body = {"provider": "sandbox", "model": "m1", "prompt": "a cat", "params": {}} | overrides
    created = await tasks.create(
        project.principal,
        project.project_id,
        key or uuid.uuid4().hex,
        NewTask(**body),
        trace_id,
    )
    task_id = uuid.UUID(created.snapshot["id"])
    async with tasks.db.connection() as conn:
        attempt_id = await conn.fetchval(
            "SELECT current_attempt_id FROM generation_tasks WHERE id = $1", task_id
        )
    return task_id, attempt_id
