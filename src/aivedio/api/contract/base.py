"""What an operation of the route table says, the credentials, and the parts operations share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from aivedio.api import models as m

Location = Literal["path", "query", "header", "cookie"]


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    location: Location
    schema: dict[str, Any]
    description: str = ""
    required: bool = False


@dataclass(frozen=True, slots=True)
class Body:
    model: type[BaseModel] | None = None
    schema: dict[str, Any] | None = None  # instead of a model
    content_type: str = "application/json"
    required: bool = True
    description: str = ""


@dataclass(frozen=True, slots=True)
class Reply:
    description: str
    model: type[BaseModel] | None = None
    content_type: str | None = "application/json"  # None: no body
    schema: dict[str, Any] | None = None  # instead of a model
    headers: tuple[tuple[str, str], ...] = ()  # name, description
    links: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    operation_id: str
    tag: str
    summary: str
    replies: dict[int, Reply]
    description: str = ""
    security: tuple[tuple[str, ...], ...] = ()  # alternatives, each a set of schemes; (): none
    params: tuple[Param, ...] = ()
    body: Body | None = None
    stream: bool = False  # an SSE or WebSocket stream: never ends by itself


# -- credentials ---------------------------------------------------------------------------------

KEY = ("apiKey",)
READ = (KEY, ("session",))  # a safe method: the cookie needs no CSRF header
WRITE = (KEY, ("session", "csrf"))  # an unsafe method authorized by the cookie needs it
STREAM = (KEY, ("session",), ("streamToken",), ("streamTokenCookie",))

SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    "apiKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "`Authorization: Bearer <api_key>` (`aivedio admin create-project`); wins "
        "when a request also carries a session cookie",
    },
    "session": {
        "type": "apiKey",
        "in": "cookie",
        "name": "aivedio_session",
        "description": "the HttpOnly browser session from `POST /v1/sessions`; an unsafe method "
        "(POST, DELETE) also needs the `csrf` header",
    },
    "csrf": {
        "type": "apiKey",
        "in": "header",
        "name": "X-Aivedio-CSRF",
        "description": "any value; required with the session cookie on unsafe methods (and "
        "`Sec-Fetch-Site`, when sent, must be `same-origin`)",
    },
    "streamToken": {
        "type": "apiKey",
        "in": "query",
        "name": "token",
        "description": "a stream token from `POST /v1/stream-tokens` (<= 60 s, one project)",
    },
    "streamTokenCookie": {
        "type": "apiKey",
        "in": "cookie",
        "name": "aivedio_stream_token",
        "description": "the same stream token, in a cookie",
    },
}

# -- shared parts --------------------------------------------------------------------------------

UUID = {"type": "string", "format": "uuid"}
PROJECT = Param("project_id", "path", UUID, "the project", required=True)
TASK = Param("task_id", "path", UUID, "the task", required=True)
ASSET = Param("asset_id", "path", UUID, "the asset (`Snapshot.asset.id`)", required=True)
RETRY_AFTER = (("Retry-After", "seconds to wait before retrying"),)


def error(description: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(description, m.ErrorResponse, headers=headers)


UNAUTHORIZED = error(
    "`unauthorized`: no credential, or an unknown, expired or revoked one",
    (("WWW-Authenticate", '`Bearer realm="aivedio"`'),),
)
CSRF = error(
    "`csrf_refused`: authorized by the session cookie without `X-Aivedio-CSRF`, or "
    "`Sec-Fetch-Site` other than `same-origin`"
)
NOT_FOUND = error(
    "`not_found`: unknown project or task, one of another tenant or outside the session's "
    "project, or a malformed id: all answered alike"
)
UNAVAILABLE = error("`unavailable`: PostgreSQL is unavailable; nothing was written", RETRY_AFTER)
TOO_LARGE = error("`body_too_large`: over the size limit (64 KiB; 4 KiB for small bodies)")
MEDIA_TYPE = error("`unsupported_media_type`: the body is not `application/json`")
INVALID = error(
    "`invalid_json`: the body is not JSON; `validation_failed`: field errors, listed in `fields`"
)


def task_links(include_get: bool = True) -> dict[str, Any]:
    """Links from an answer carrying ``{"task": Snapshot}`` to the task's other operations."""
    params = {"project_id": "$request.path.project_id", "task_id": "$response.body#/task/id"}
    names = ["GetTask", "CancelTask", "RetryTask", "GetTaskAudit", "GetTaskEvents"]
    return {
        name: {"operationId": name, "parameters": params}
        for name in names
        if include_get or name != "GetTask"
    }


def task_reply(description: str) -> Reply:
    return Reply(description, m.TaskResponse, links=task_links())
