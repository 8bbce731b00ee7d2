"""Who is calling a REST endpoint: ``Authorization: Bearer <api_key>``, or the browser session
cookie ``aivedio_session`` (``api/sessions.py``: CSRF check for unsafe methods, project scope)."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from aivedio.api.sessions import Caller, bearer, caller_of
from aivedio.db.pool import Database
from aivedio.state.tasks import Principal

__all__ = ["Caller", "authenticate", "bearer_token", "caller_of"]


def bearer_token(request: Request) -> str | None:
    return bearer(request)


async def authenticate(
    db: Database, request: Request, project_id: uuid.UUID | None = None
) -> Principal:
    """The tenant's principal; 401 without a valid credential, 403 ``csrf_refused`` for an
    unsafe cookie request without the CSRF header, 404 for a project outside a session's scope
    (``project_id``, default: the path's)."""
    return (await caller_of(db, request, project_id)).principal
