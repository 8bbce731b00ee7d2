"""Error responses, bounded body reading, body validation with the contract's models, responses
serialised through them, the trace-id middleware."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aivedio.api.models import ErrorDetail, ErrorResponse, FieldError
from aivedio.logs import log, new_trace_id, trace_id_var

M = TypeVar("M", bound=BaseModel)

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


def respond(
    body: BaseModel, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A JSON response serialised through its contract model (``api.models``)."""
    return Response(body.model_dump_json(), status_code, headers, media_type="application/json")


def error_response(exc: ApiError) -> Response:
    fields = [FieldError(**f) for f in exc.fields] if exc.fields is not None else None
    detail = ErrorDetail(
        code=exc.code, message=exc.message, fields=fields, trace_id=trace_id_var.get()
    )
    return Response(
        ErrorResponse(error=detail).model_dump_json(exclude_none=True),
        exc.status,
        exc.headers,
        media_type="application/json",
    )


def body_errors(model: type[M], payload: Any) -> tuple[M | None, list[dict[str, str]]]:
    """``payload`` validated by a request model: the model, or the field errors of a 422
    ``validation_failed`` (the model's own stable messages where it has them)."""
    try:
        return model.model_validate(payload), []
    except ValidationError as exc:
        messages: dict[str, str] = getattr(model, "field_messages", {})
        body_error: tuple[str, str] | None = getattr(model, "body_error", None)
        fields: list[dict[str, str]] = []
        for err in exc.errors(include_url=False, include_input=False):
            loc = err["loc"]
            if body_error is not None and (not loc or err["type"] == "extra_forbidden"):
                field, message = body_error
            else:
                field = ".".join(str(p) for p in loc) or "body"
                message = messages.get(str(loc[0]), err["msg"]) if loc else err["msg"]
            if {"field": field, "message": message} not in fields:
                fields.append({"field": field, "message": message})
        return None, fields


def parse_body(model: type[M], payload: Any) -> M:
    """``body_errors``, raising the 422 ``validation_failed`` when there are errors."""
    body, fields = body_errors(model, payload)
    if body is None:
        raise ApiError(422, "validation_failed", "the request is invalid", fields=fields)
    return body


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
        return json.loads(b"".join(chunks), parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(422, "invalid_json", "the body is not valid JSON") from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: valid JSON syntax, but no number PostgreSQL stores
        raise ValueError(f"{text} is out of range")
    return value


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
        except ClientDisconnect:
            # Gone before its body was read: nobody to answer, and no error of the app's; its
            # line says 499 (nginx's "client closed request") instead of an ASGI traceback.
            status = 499
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
