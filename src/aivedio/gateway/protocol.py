"""HTTP request-head parsing for the SSE endpoint (pure: bytes in, ``SseRequest`` out).

Only ``GET /v1/projects/{project_id}/events`` is read here; every other request is handed to the
ASGI server untouched (see ``server.py``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

EVENTS_PATH = re.compile(r"^/v1/projects/([^/?#]+)/events$")
PREFIX = b"GET /v1/projects/"
_CURSOR = re.compile(r"^(\d{1,19})-(\d{1,19})$")


class BadRequest(ValueError):
    """The head is not a request this endpoint can answer (answered 400)."""


@dataclass(frozen=True, slots=True)
class Cursor:
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class SseRequest:
    project_id: uuid.UUID
    cursor: Cursor | None  # from ?after= or Last-Event-ID (the query wins)
    task_id: str | None
    token: str | None  # ?token= or the aivedio_stream_token cookie
    bearer: str | None  # Authorization: Bearer <api_key>
    origin: str | None


def parse_cursor(text: str) -> Cursor:
    match = _CURSOR.match(text.strip())
    if match is None:
        raise BadRequest("a cursor is <epoch>-<seq>")
    return Cursor(int(match.group(1)), int(match.group(2)))


def request_line(head: bytes) -> tuple[str, str] | None:
    """``(method, target)`` once the first line is complete, else ``None``."""
    end = head.find(b"\r\n")
    if end < 0:
        return None
    parts = head[:end].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return ("", "")
    return parts[0], parts[1]


def is_events_target(target: str) -> bool:
    return EVENTS_PATH.match(target.partition("?")[0]) is not None


def parse_head(head: bytes) -> SseRequest:
    """Parse a complete head (ending in CRLF CRLF) of an SSE request."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = ([*lines[0].split(" "), "", "", ""])[:3]
    if method != "GET":
        raise BadRequest("the event stream is read with GET")
    path, _, query = target.partition("?")
    match = EVENTS_PATH.match(path)
    if match is None:
        raise BadRequest("not an event stream path")
    try:
        project_id = uuid.UUID(unquote(match.group(1)))
    except ValueError as exc:
        raise BadRequest("project_id is not a UUID") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        headers[name.lower()] = value.strip()
    params = dict(parse_qsl(query, keep_blank_values=True))
    cursor_text = params.get("after") or headers.get("last-event-id") or None
    cursor = parse_cursor(cursor_text) if cursor_text else None
    task_id = params.get("task_id") or None
    if task_id is not None:
        try:
            task_id = str(uuid.UUID(task_id))
        except ValueError as exc:
            raise BadRequest("task_id is not a UUID") from exc
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    bearer = credential.strip() if scheme.lower() == "bearer" and credential.strip() else None
    token = params.get("token") or cookies(headers.get("cookie", "")).get("aivedio_stream_token")
    return SseRequest(project_id, cursor, task_id, token or None, bearer, headers.get("origin"))


def cookies(header: str) -> dict[str, str]:
    jar: dict[str, str] = {}
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name:
            jar[name] = value.strip().strip('"')
    return jar
