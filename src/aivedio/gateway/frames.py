"""Frame bytes: every frame is encoded once per node and the same ``bytes`` written to every
connection. An ``Event`` carries its SSE frame (encoded at once) and its WebSocket frame (encoded
on first use by a WebSocket connection, then cached on the event)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

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
    """One task event of one project, with its SSE frame already encoded.

    ``coalesce`` is ``(task_id, status, stage)`` for a non-final event: a queued event with the
    same key is only older progress and may be replaced by this one. Final events have ``None``.
    A control frame (``reset``, ``start``, a command reply) is an event with ``seq`` 0 and
    ``kind`` naming it; ``data`` is its JSON body (the public payload for ``task.status``), ``ws``
    its WebSocket frame once one connection needed it.
    """

    seq: int
    task_id: str
    frame: bytes
    coalesce: tuple[str, str, str] | None
    epoch: int = 0
    data: dict[str, Any] | None = None
    kind: str = "task.status"
    ws: bytes | None = None
    # Never sent: when the event's outbox row was stored (Unix time, DB clock; the age metric)
    # and the trace id that entered with its callback or API request (the frame's log line).
    stored_at: float | None = None
    trace_id: str | None = None


def dumps(value: Any) -> str:
    """Compact, sorted keys, UTF-8 as is: the bytes ``json.dumps(value, separators=(",", ":"),
    sort_keys=True, ensure_ascii=False)`` gives, at a fifth of its cost (a replay of 1,000 events
    builds 1,000 frames)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def make_event(
    epoch: int,
    seq: int,
    public: dict[str, Any],
    comment: str = "",
    *,
    stored_at: float | None = None,
    trace_id: str | None = None,
) -> Event:
    """``comment`` (one line, off by default) goes into the SSE frame as a ``: ...`` line, which
    EventSource ignores: the diagnostic timing line of ``GatewayConfig.timing``. ``stored_at``
    and ``trace_id`` ride the event for the gateway's metrics and logs, never into a frame."""
    payload = {k: public.get(k) for k in PUBLIC_FIELDS}
    payload["event_id"] = seq
    return event_of(epoch, seq, payload, comment, stored_at=stored_at, trace_id=trace_id)


def event_of(
    epoch: int,
    seq: int,
    payload: dict[str, Any],
    comment: str = "",
    *,
    stored_at: float | None = None,
    trace_id: str | None = None,
) -> Event:
    """:func:`make_event` of a payload that is already what a browser sees: exactly the
    ``PUBLIC_FIELDS``, ``event_id`` the seq (``domain.public.stored_event`` makes one from a
    stored row). The replay builds 1,000 of them per page: one dict per event, not two."""
    task_id = str(payload["task_id"])
    status = str(payload["status"])
    extra = f": {comment}\n".encode() if comment else b""
    # bytes straight from orjson: dumps()'s text, encoded again, costs a quarter more per frame
    data = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    frame = b"id: %d-%d\nevent: task.status\ndata: %b\n%b\n" % (epoch, seq, data, extra)
    final = status in FINAL_PUBLIC_STATUSES
    coalesce = None if final else (task_id, status, str(payload["stage"]))
    return Event(
        seq, task_id, frame, coalesce, epoch, payload, stored_at=stored_at, trace_id=trace_id
    )


def timing_comment(relayed_at: object, dispatched_at: object, written_at: float) -> str:
    """``timing <relayed> <dispatched> <written>``: Unix times (``-`` where the message had none)
    of the relay's publish, the dispatcher's PUBLISH and this node's frame, for
    ``aivedio bench e2e``. Only numbers: nothing of the event or its route."""

    def number(value: object) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return f"{value:.6f}"
        return "-"

    return f"timing {number(relayed_at)} {number(dispatched_at)} {written_at:.6f}"


def ws_message(event: Event) -> dict[str, Any]:
    """The JSON of an event's WebSocket text frame (seed §12.5.7)."""
    data = event.data or {}
    if event.kind != "task.status":
        return {"type": event.kind, **data}
    return {
        "type": "task.status",
        "event_id": event.seq,
        "cursor": f"{event.epoch}-{event.seq}",
        "task_id": data.get("task_id"),
        "task_version": data.get("task_version"),
        "payload": {k: data.get(k) for k in WS_PAYLOAD_FIELDS},
    }


WS_PAYLOAD_FIELDS = ("status", "stage", "progress", "asset_id", "error")


def control(kind: str, sse: bytes, data: dict[str, Any]) -> Event:
    """A frame outside the event sequence (seq 0), in both encodings."""
    return Event(0, "", sse, None, 0, data, kind)


def reset_event(epoch: int, head: int, reason: str) -> Event:
    return control(
        "reset", reset_frame(epoch, head, reason), {"reason": reason, "cursor": f"{epoch}-{head}"}
    )


def start_event(epoch: int, head: int) -> Event:
    return control("start", start_comment(epoch, head), {"cursor": f"{epoch}-{head}"})


def reply_event(data: dict[str, Any]) -> Event:
    """A WebSocket command's ``ack`` or ``error`` (SSE has no commands: no SSE bytes)."""
    kind = str(data.pop("type"))
    return control(kind, b"", data)


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
        426: "Upgrade Required",
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
