"""The sandbox's stream outage: ``POST /v1/projects/{project_id}/sandbox/stream-outage`` makes
this gateway cut the project's open streams without a goodbye frame and refuse its new ones for
a while, so a browser shows what a lost network does (retry with backoff, "live updates paused"
with polling, then an exact resume from its cursor). Mounted by the ``gateway`` role only where
the sandbox provider is enabled; a chaos tool, never a production control."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.api.auth import authenticate
from aivedio.api.http import ApiError, parse_body, read_json, respond
from aivedio.api.models import StreamOutage, StreamOutageBody
from aivedio.db.pool import Database
from aivedio.db.queries import q

__all__ = ["Outages", "stream_outage_routes"]


class Outages:
    """Projects whose streams this gateway refuses, until a monotonic deadline each."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._until: dict[uuid.UUID, float] = {}

    def start(self, project_id: uuid.UUID, seconds: float) -> None:
        self._until[project_id] = self.clock() + seconds

    def active(self, project_id: uuid.UUID) -> float:
        """Seconds left of the project's outage (0: none)."""
        until = self._until.get(project_id)
        if until is None:
            return 0.0
        left = until - self.clock()
        if left <= 0:
            del self._until[project_id]
            return 0.0
        return left


def stream_outage_routes(db: Database, kill: Callable[[uuid.UUID, float], int]) -> list[BaseRoute]:
    """``kill(project_id, seconds)`` closes the project's streams and starts the outage; it
    answers how many streams it closed."""

    async def start(request: Request) -> Response:
        principal = await authenticate(db, request)
        try:
            project_id = uuid.UUID(request.path_params["project_id"])
        except ValueError as exc:
            raise ApiError(404, "not_found", "project not found") from exc
        async with db.connection() as conn:
            owned = await conn.fetchval(q("project_of_tenant"), project_id, principal.tenant_id)
        if owned is None:
            raise ApiError(404, "not_found", "project not found")
        body = parse_body(StreamOutageBody, await read_json(request, 4096))
        closed = kill(project_id, body.seconds)
        until = datetime.now(UTC) + timedelta(seconds=body.seconds)
        return respond(StreamOutage(closed=closed, until=until), 202)

    return [
        Route("/v1/projects/{project_id}/sandbox/stream-outage", start, methods=["POST"]),
    ]
