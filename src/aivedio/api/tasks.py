"""Task routes: create (Idempotency-Key), snapshot, list, cancel, retry, audit, timeline."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aivedio.api.auth import authenticate
from aivedio.api.http import ApiError, body_errors, read_json, respond
from aivedio.api.models import (
    AuditResponse,
    CreateTaskBody,
    ListQuery,
    Snapshot,
    TaskEvents,
    TaskList,
    TaskResponse,
)
from aivedio.config import ApiConfig
from aivedio.db.pool import Database
from aivedio.logs import trace_id_var
from aivedio.state.tasks import NewTask, TaskStore

__all__ = ["PARAMS_MAX_BYTES", "CreateTaskBody", "TaskRoutes"]

PARAMS_MAX_BYTES = 16 * 1024


def _task(snapshot: dict[str, Any]) -> TaskResponse:
    return TaskResponse(task=Snapshot.model_validate(snapshot))


@dataclass(frozen=True, slots=True)
class TaskRoutes:
    db: Database
    tasks: TaskStore
    config: ApiConfig

    def routes(self) -> list[Route]:
        base = "/v1/projects/{project_id}/tasks"
        return [
            Route(base, self.create, methods=["POST"]),
            Route(base, self.list, methods=["GET"]),
            Route(base + "/{task_id}", self.get, methods=["GET"]),
            Route(base + "/{task_id}/cancel", self.cancel, methods=["POST"]),
            Route(base + "/{task_id}/retry", self.retry, methods=["POST"]),
            Route(base + "/{task_id}/audit", self.audit, methods=["GET"]),
            Route(base + "/{task_id}/events", self.events, methods=["GET"]),
        ]

    async def create(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        key = request.headers.get("idempotency-key", "")
        fields = []
        if not 1 <= len(key) <= 255 or not key.isprintable():
            fields.append(
                {"field": "Idempotency-Key", "message": "header required, 1-255 printable chars"}
            )
        payload = await read_json(request, self.config.body_limit_bytes)
        body, errors = body_errors(CreateTaskBody, payload)
        fields.extend(errors)
        if body is not None:
            if body.provider not in self.config.providers:
                known = ", ".join(sorted(self.config.providers))
                fields.append({"field": "provider", "message": f"unknown provider; known: {known}"})
            if len(json.dumps(body.params)) > PARAMS_MAX_BYTES:
                fields.append({"field": "params", "message": f"at most {PARAMS_MAX_BYTES} bytes"})
        if fields or body is None:
            raise ApiError(422, "validation_failed", "the request is invalid", fields=fields)
        created = await self.tasks.create(
            principal,
            project_id,
            key,
            NewTask(body.provider, body.model, body.prompt, body.params),
            trace_id_var.get(),
        )
        headers = {"Idempotent-Replayed": "true"} if created.replayed else {}
        return respond(_task(created.snapshot), 202, headers)

    async def get(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        task_id = _path_uuid(request, "task_id", "task")
        return respond(_task(await self.tasks.snapshot(principal, project_id, task_id)))

    async def list(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        query, errors = body_errors(ListQuery, dict(request.query_params))
        if query is None or query.limit > self.config.page_size_max:
            if query is not None or any(e["field"] == "limit" for e in errors):
                errors = [{"field": "limit", "message": f"1..{self.config.page_size_max}"}]
            raise ApiError(422, "validation_failed", "the request is invalid", fields=errors)
        try:
            result = await self.tasks.list(principal, project_id, query.limit, query.page)
        except ValueError as exc:
            raise ApiError(
                422,
                "validation_failed",
                "the request is invalid",
                fields=[{"field": "page", "message": "not a page token from this API"}],
            ) from exc
        return respond(TaskList.model_validate(result))

    async def cancel(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        task_id = _path_uuid(request, "task_id", "task")
        snapshot = await self.tasks.cancel(principal, project_id, task_id, trace_id_var.get())
        return respond(_task(snapshot), 202)

    async def retry(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        task_id = _path_uuid(request, "task_id", "task")
        snapshot = await self.tasks.retry(principal, project_id, task_id, trace_id_var.get())
        return respond(_task(snapshot), 202)

    async def audit(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        task_id = _path_uuid(request, "task_id", "task")
        audit = await self.tasks.audit(principal, project_id, task_id)
        return respond(AuditResponse.model_validate(audit))

    async def events(self, request: Request) -> Response:
        principal = await authenticate(self.db, request)
        project_id = _path_uuid(request, "project_id", "project")
        task_id = _path_uuid(request, "task_id", "task")
        timeline = await self.tasks.events(principal, project_id, task_id)
        return respond(TaskEvents.model_validate(timeline))


def _path_uuid(request: Request, name: str, what: str) -> uuid.UUID:
    try:
        return uuid.UUID(request.path_params[name])
    except ValueError as exc:
        raise ApiError(404, "not_found", f"{what} not found") from exc
