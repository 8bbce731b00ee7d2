"""Error responses, bounded body reading, the trace-id middleware."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aivedio.logs import log, new_trace_id, trace_id_var

logger = logging.getLogger("aivedio.api")

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


class ApiError(Exception):
    """An error answered with a stable code (``{"error": {"code", "message", ...}}``)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        fields: list[dict[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields
        self.headers = headers or {}


def invalid_field(field: str, message: str) -> ApiError:
    """The API's one answer to a bad field: 422 ``validation_failed`` naming it in ``fields``."""
    return ApiError(
        422,
        "validation_failed",
        "the request is invalid",
        fields=[{"field": field, "message": message}],
    )


def error_response(exc: ApiError) -> JSONResponse:
    body: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if exc.fields is not None:
        body["fields"] = exc.fields
    body["trace_id"] = trace_id_var.get()
    return JSONResponse({"error": body}, status_code=exc.status, headers=exc.headers)


async def read_json(request: Request, limit: int) -> Any:
    """The JSON body, read with a size bound; 413, 415 and 422 for what does not fit."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "unsupported_media_type", "send application/json")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, "body_too_large", f"the body may be at most {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"the body may be at most {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(422, "invalid_json", "the body is not valid JSON") from exc


class TraceMiddleware:
    """Gives each request a trace id (from a valid ``traceparent``); logs one line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace_id = None
        for name, value in scope["headers"]:
            if name == b"traceparent":
                match = _TRACEPARENT.match(value.decode("latin-1"))
                if match:
                    trace_id = "trc_" + match.group(1)
        trace_id = trace_id or new_trace_id()
        token = trace_id_var.set(trace_id)
        started = time.perf_counter()
        status = 0

        async def send_with_trace(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-trace-id", trace_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_trace)
        finally:
            log(
                logger,
                logging.INFO,
                "request",
                method=scope["method"],
                path=scope["path"],
                status=status,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )
            trace_id_var.reset(token)


def no_content() -> Response:
    return Response(status_code=204)
