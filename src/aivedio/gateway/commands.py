"""WebSocket client commands (pure: text in, ``Command`` or ``CommandError`` out).

``{"type": "subscribe", "request_id", "task_id"?}`` narrows the connection to one task of its
project (or widens it back to all with no ``task_id``); ``{"type": "unsubscribe", "request_id"}``
stops task events until the next ``subscribe`` (the cursor still advances; ``resume`` brings
back what was skipped); ``{"type": "resume", "request_id", "after": "<cursor>"}`` replays from a
cursor on the open connection. Each is answered ``{"type": "ack", "request_id"}`` or
``{"type": "error", "request_id", "code", "message"}``. Cancel and retry change state: they are
REST calls only (``unsupported_command``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from aivedio.gateway.protocol import BadRequest, Cursor, parse_cursor

COMMANDS = ("subscribe", "unsubscribe", "resume")
MAX_REQUEST_ID = 64


class CommandError(Exception):
    def __init__(self, request_id: str | int | None, code: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Command:
    type: str
    request_id: str | int
    task_id: str | None = None
    after: Cursor | None = None


def parse_command(text: str) -> Command:
    try:
        raw: Any = json.loads(text)
    except ValueError as exc:
        raise CommandError(None, "bad_command", "a command is a JSON object") from exc
    if not isinstance(raw, dict):
        raise CommandError(None, "bad_command", "a command is a JSON object")
    request_id = raw.get("request_id")
    if (
        isinstance(request_id, bool)
        or not isinstance(request_id, str | int)
        or (isinstance(request_id, str) and not 0 < len(request_id) <= MAX_REQUEST_ID)
    ):
        raise CommandError(None, "bad_command", "request_id (a short string or number) is required")
    kind = raw.get("type")
    if kind not in COMMANDS:
        raise CommandError(
            request_id,
            "unsupported_command",
            "commands are subscribe, unsubscribe, resume; cancel and retry are REST calls",
        )
    if kind == "subscribe":
        task_id = raw.get("task_id")
        if task_id is None:
            return Command("subscribe", request_id)
        try:
            return Command("subscribe", request_id, task_id=str(uuid.UUID(str(task_id))))
        except ValueError as exc:
            raise CommandError(request_id, "bad_request", "task_id is not a UUID") from exc
    if kind == "resume":
        try:
            return Command("resume", request_id, after=parse_cursor(str(raw["after"])))
        except (KeyError, BadRequest) as exc:
            raise CommandError(
                request_id, "bad_request", "after is a cursor <epoch>-<seq>"
            ) from exc
    return Command("unsubscribe", request_id)
