"""The event streams (SSE, WebSocket) and the provider webhooks."""

from __future__ import annotations

from aivedio.api import models as m
from aivedio.api.contract.base import (
    MEDIA_TYPE,
    PROJECT,
    RETRY_AFTER,
    STREAM,
    UNAUTHORIZED,
    UUID,
    Body,
    Operation,
    Param,
    Reply,
    error,
)

# -- streams -------------------------------------------------------------------------------------

STREAM_PARAMS = (
    PROJECT,
    Param(
        "after",
        "query",
        {"type": "string", "pattern": m.CURSOR_PATTERN},
        "resume after this cursor (`<epoch>-<seq>`); wins over `Last-Event-ID`",
    ),
    Param("task_id", "query", UUID, "only this task's events (the cursor still advances)"),
)
STREAM_REFUSALS: dict[int, Reply] = {
    400: error("`bad_request`: a malformed cursor, task id or project id"),
    401: UNAUTHORIZED,
    404: error(
        "`not_found`: a project that does not exist, of another tenant, or outside the token's "
        "or the session's project: all answered alike"
    ),
    429: error("`too_many_connections` for this user or tenant", RETRY_AFTER),
    503: error("`rate_limited`, `shutdown` or `unavailable`", RETRY_AFTER),
}
EVENTS_DOC = "docs/reference/events.md"

STREAM_OPERATIONS = [
    Operation(
        "get",
        "/v1/projects/{project_id}/events",
        "StreamEvents",
        "streams",
        "The project's event stream (Server-Sent Events)",
        description="Frames: `task.status` (`id: <epoch>-<seq>`, `data:` an `EventPayload`), "
        "`reset` (`ResetFrame`: re-read the snapshot), `close` (`CloseFrame`), and comments "
        f"(`: ping <unix>`, `: start <cursor>`). See {EVENTS_DOC}.",
        security=STREAM,
        params=(
            *STREAM_PARAMS,
            Param("Last-Event-ID", "header", {"type": "string"}, "resume after this cursor"),
        ),
        replies={
            200: Reply(
                "the stream, until the server or the client closes it",
                content_type="text/event-stream",
                schema={"type": "string"},
            ),
            **STREAM_REFUSALS,
        },
        stream=True,
    ),
    Operation(
        "get",
        "/v1/projects/{project_id}/ws",
        "StreamEventsWebSocket",
        "streams",
        "The project's event stream (WebSocket)",
        description="An RFC 6455 upgrade; the same events as JSON text frames, the commands "
        "`subscribe`, `unsubscribe` and `resume`. A browser's `Origin` must be allowed (else "
        f"403 `origin_not_allowed`). See {EVENTS_DOC}.",
        security=STREAM,
        params=(
            *STREAM_PARAMS,
            Param("Upgrade", "header", {"type": "string", "enum": ["websocket"]}, required=True),
            Param("Sec-WebSocket-Version", "header", {"type": "string", "enum": ["13"]}),
            Param("Sec-WebSocket-Key", "header", {"type": "string"}, required=True),
        ),
        replies={
            101: Reply("switching to the WebSocket protocol", content_type=None),
            **STREAM_REFUSALS,
            403: error("`origin_not_allowed`: this `Origin` (or none, with a cookie)"),
            426: error(
                "`bad_request`: another WebSocket version",
                (("Sec-WebSocket-Version", "`13`"),),
            ),
        },
        stream=True,
    ),
]

# -- callbacks, operations, documents, the web page ----------------------------------------------

CALLBACK_OPERATIONS = [
    Operation(
        "post",
        "/v1/callbacks/{provider}",
        "ReceiveCallback",
        "callbacks",
        "A provider's webhook",
        description="Verified on the raw body by the provider's scheme (Standard Webhooks "
        "`webhook-id` / `webhook-timestamp` / `webhook-signature`, an ED25519 signature, or a "
        "callback `?token=`), stored durably in the callback inbox, then answered 204. See "
        "docs/reference/callbacks.md.",
        params=(Param("provider", "path", {"type": "string"}, "e.g. `sandbox`", required=True),),
        body=Body(schema={"type": "object"}, description="the provider's event (a JSON object)"),
        replies={
            204: Reply("stored now, or already stored (a duplicate)", content_type=None),
            400: error("`invalid_encoding`: not UTF-8; `bad_request`: a malformed request"),
            401: error("`unauthorized`: the signature or token was refused"),
            404: error("`not_found`: no provider of that name is configured"),
            405: error("`method_not_allowed`", (("Allow", "`POST`"),)),
            408: error("`request_timeout`: the body did not arrive in time"),
            413: error("`body_too_large`: over the provider's limit (256 KiB by default)"),
            414: error("`uri_too_long`: the query string is over 4 KiB"),
            415: MEDIA_TYPE,
            422: error("`invalid_json`, `invalid_payload`: not a storable JSON object"),
            431: error("`headers_too_large`"),
            500: error("`internal`: the database refused the row, or an adapter hook failed"),
            503: error(
                "`unavailable`: keys, the database or the queue are unavailable", RETRY_AFTER
            ),
        },
    ),
]
