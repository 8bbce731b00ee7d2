"""HTTP request-head parsing for the stream endpoints (pure: bytes in, ``StreamRequest`` out).

Only ``GET /v1/projects/{project_id}/events`` (SSE) and ``GET /v1/projects/{project_id}/ws``
(WebSocket upgrade) are read here; every other request is handed to the ASGI server untouched
(see ``process/http_server.py``).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from aivedio.gateway.wsframes import valid_key

SESSION_COOKIE = "aivedio_session"  # api/sessions.py (kept here so this module stays pure)

EVENTS_PATH = re.compile(r"^/v1/projects/([^/?#]+)/events$")
STREAM_PATH = re.compile(r"^/v1/projects/([^/?#]+)/(events|ws)$")
PREFIX = b"GET /v1/projects/"
_CURSOR = re.compile(r"^(\d{1,19})-(\d{1,19})$")


class BadRequest(ValueError):
    """The head is not a request this endpoint can answer (answered 400)."""

    status = 400
    headers: dict[str, str] = {}  # noqa: RUF012 (read-only class defaults)


class UpgradeRequired(BadRequest):
    """A WebSocket handshake of another protocol version (answered 426)."""

    status = 426
    headers = {"Sec-WebSocket-Version": "13"}  # noqa: RUF012


@dataclass(frozen=True, slots=True)
class Cursor:
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class StreamRequest:
    project_id: uuid.UUID
    cursor: Cursor | None  # from ?after= or Last-Event-ID (the query wins)
    task_id: str | None
    token: str | None  # ?token= or the aivedio_stream_token cookie
    bearer: str | None  # Authorization: Bearer <api_key>
    origin: str | None
    ws_key: str | None = None  # Sec-WebSocket-Key: set for (and only for) a WebSocket upgrade
    host: str | None = None
    token_from_cookie: bool = False
    session: str | None = None  # the browser session cookie ``aivedio_session``

    @property
    def websocket(self) -> bool:
        return self.ws_key is not None


SseRequest = StreamRequest  # the name before the WebSocket endpoint existed


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
    """An SSE or WebSocket stream path (the lean path of ``process/http_server.py``)."""
    return STREAM_PATH.match(target.partition("?")[0]) is not None


def is_ws_target(target: str) -> bool:
    match = STREAM_PATH.match(target.partition("?")[0])
    return match is not None and match.group(2) == "ws"


def parse_head(head: bytes) -> StreamRequest:
    """Parse a complete head (ending in CRLF CRLF) of an SSE request or WebSocket upgrade."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = ([*lines[0].split(" "), "", "", ""])[:3]
    if method != "GET":
        raise BadRequest("the event stream is read with GET")
    path, _, query = target.partition("?")
    match = STREAM_PATH.match(path)
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
    jar = cookies(headers.get("cookie", ""))
    cookie = jar.get("aivedio_stream_token") or None
    token = params.get("token") or cookie
    ws_key = websocket_key(headers) if match.group(2) == "ws" else None
    return StreamRequest(
        project_id,
        cursor,
        task_id,
        token or None,
        bearer,
        headers.get("origin") or None,
        ws_key,
        headers.get("host"),
        token_from_cookie=bool(cookie) and not params.get("token"),
        session=jar.get(SESSION_COOKIE) or None,
    )


def origin_allowed(req: StreamRequest, allowed: tuple[str, ...]) -> bool:
    """The WebSocket Origin allow-list (cross-site WebSocket hijacking: a browser sends its
    cookie with any page's WebSocket, so the Origin decides). ``allowed`` empty: the same origin
    as the ``Host`` header only. No Origin means no browser: allowed only with an API key (and no
    token), never with a cookie (the stream token's or the browser session's)."""
    if req.origin is None:
        return req.bearer is not None and req.token is None
    origin = req.origin.lower().rstrip("/")
    if allowed:
        return any(origin == o.lower().rstrip("/") for o in allowed)
    host = (req.host or "").lower()
    return bool(host) and origin.partition("://")[2] == host


def websocket_key(headers: dict[str, str]) -> str:
    """Check an RFC 6455 opening handshake; its ``Sec-WebSocket-Key``."""
    if headers.get("upgrade", "").lower() != "websocket":
        raise BadRequest("a WebSocket upgrade is required")
    if "upgrade" not in {t.strip().lower() for t in headers.get("connection", "").split(",")}:
        raise BadRequest("a WebSocket upgrade is required")
    if headers.get("sec-websocket-version") != "13":
        raise UpgradeRequired("only WebSocket version 13 is supported")
    key = headers.get("sec-websocket-key", "")
    if not valid_key(key):
        raise BadRequest("Sec-WebSocket-Key is not 16 base64 bytes")
    return key


def cookies(header: str) -> dict[str, str]:
    jar: dict[str, str] = {}
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name:
            jar[name] = value.strip().strip('"')
    return jar
