"""SSE bytes: every frame is encoded once and the same ``bytes`` written to every connection."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aivedio.domain.statuses import FINAL_PUBLIC_STATUSES

# What a browser may see of an event: anything else a publisher sends is dropped here.
PUBLIC_FIELDS = (
    "event_id",
    "task_id",
    "task_version",
    "status",
    "stage",
    "progress",
    "asset_id",
    "error",
)

RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache, no-transform\r\n"
    b"X-Accel-Buffering: no\r\n"
    b"Connection: keep-alive\r\n"
    b"\r\n"
)


@dataclass(slots=True)
class Event:
    """One task event of one project, with its frame already encoded.

    ``coalesce`` is ``(task_id, status, stage)`` for a non-final event: a queued event with the
    same key is only older progress and may be replaced by this one. Final events have ``None``.
    """

    seq: int
    task_id: str
    frame: bytes
    coalesce: tuple[str, str, str] | None


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def make_event(epoch: int, seq: int, public: dict[str, Any]) -> Event:
    payload = {k: public.get(k) for k in PUBLIC_FIELDS}
    payload["event_id"] = seq
    task_id = str(payload["task_id"])
    status = str(payload["status"])
    frame = f"id: {epoch}-{seq}\nevent: task.status\ndata: {dumps(payload)}\n\n".encode()
    final = status in FINAL_PUBLIC_STATUSES
    return Event(seq, task_id, frame, None if final else (task_id, status, str(payload["stage"])))


def retry_frame(retry_ms: int) -> bytes:
    return f"retry: {retry_ms}\n\n".encode()


def start_comment(epoch: int, seq: int) -> bytes:
    """Where the stream starts, for clients that connected without a cursor (a comment)."""
    return f": start {epoch}-{seq}\n\n".encode()


def ping_frame(unix: int) -> bytes:
    return f": ping {unix}\n\n".encode()


def reset_frame(epoch: int, head: int, reason: str) -> bytes:
    """``event: reset``: re-read the snapshot; the stream goes on from ``<epoch>-<head>``."""
    data = {"reason": reason, "cursor": f"{epoch}-{head}", "epoch": epoch, "head": head}
    return f"id: {epoch}-{head}\nevent: reset\ndata: {dumps(data)}\n\n".encode()


def close_frame(code: int, reason: str, reconnect: bool) -> bytes:
    data = {"code": code, "reason": reason, "reconnect": reconnect}
    return f"event: close\ndata: {dumps(data)}\n\n".encode()


def error_response(status: int, code: str, message: str, headers: dict[str, str]) -> bytes:
    """A plain HTTP error answer for a request refused before the stream starts."""
    body = dumps({"error": {"code": code, "message": message}}).encode()
    phrases = {
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        405: "Method Not Allowed",
        429: "Too Many Requests",
        431: "Request Header Fields Too Large",
        503: "Service Unavailable",
    }
    lines = [
        f"HTTP/1.1 {status} {phrases.get(status, 'Error')}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
