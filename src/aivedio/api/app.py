"""The Starlette application: routes, error mapping, health and metrics, the OpenAPI document
and its page. Every error is the contract's ``{"error": {...}}``, Starlette's own 404 and 405
included."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.api.docs import docs_routes
from aivedio.api.http import ApiError, TraceMiddleware, error_response, respond
from aivedio.api.models import Health, LoopDown, NotReady, Readiness
from aivedio.api.tasks import TaskRoutes
from aivedio.config import ApiConfig
from aivedio.db.pool import Database
from aivedio.errors import (
    Conflict,
    DatabaseUnavailable,
    IdempotencyMismatch,
    NotFound,
)
from aivedio.logs import log
from aivedio.process.health import Health as RoleHealth
from aivedio.state.tasks import TaskStore

logger = logging.getLogger("aivedio.api")


def create_app(
    db: Database,
    tasks: TaskStore,
    config: ApiConfig,
    extra_routes: Sequence[BaseRoute] = (),
    health: RoleHealth | None = None,
) -> Starlette:
    """The API app. ``extra_routes`` lets other roles (callbacks, gateway) share the port;
    ``health``, the process's role loops, makes ``/readyz`` name the roles that are down."""
    routes: list[BaseRoute] = [
        *_probe_routes(db, config, health),
        *docs_routes(),
        *TaskRoutes(db, tasks, config).routes(),
        *extra_routes,
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(TraceMiddleware)],
        exception_handlers=_exception_handlers(config),
    )


def _probe_routes(db: Database, config: ApiConfig, health: RoleHealth | None) -> list[BaseRoute]:
    """``/healthz``, ``/readyz`` and ``/metrics``."""

    async def healthz(request: Request) -> Response:
        return respond(Health(status="ok"))

    async def readyz(request: Request) -> Response:
        """200 when PostgreSQL answers and no role loop of the process is down; else 503 with
        what is down (``roles_down``, each loop's state in ``loops``) and Retry-After."""
        database: Literal["ok", "unavailable"] = "ok"
        try:
            async with db.connection() as conn:
                await conn.fetchval("SELECT 1")
        except DatabaseUnavailable:
            database = "unavailable"
        down = health.down() if health is not None else []
        if database == "ok" and not down:
            return respond(Readiness(status="ready"))
        body = NotReady(
            status="unavailable",
            database=database,
            roles_down=list(dict.fromkeys(u.role for u in down)),
            loops=[LoopDown(**u.as_dict()) for u in down],
        )
        headers = {"Retry-After": str(config.retry_after_s), "Cache-Control": "no-store"}
        return respond(body, 503, headers)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
    ]


_Handler = Callable[[Request, Exception], Awaitable[Response]]


def _exception_handlers(config: ApiConfig) -> dict[Any, _Handler]:
    """Every error in the contract's shape, Starlette's own 404 and 405 included."""

    async def on_unavailable(request: Request, exc: Exception) -> Response:
        log(logger, logging.WARNING, "database unavailable", error=str(exc))
        return error_response(
            ApiError(
                503,
                "unavailable",
                "the service is temporarily unavailable; retry later",
                headers={"Retry-After": str(config.retry_after_s)},
            )
        )

    return {
        HTTPException: _on_http,
        500: _on_internal,
        ApiError: _on_api_error,
        DatabaseUnavailable: on_unavailable,
        NotFound: _on_not_found,
        Conflict: _on_conflict,
        IdempotencyMismatch: _on_idempotency,
    }


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _on_not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, "not_found", f"{exc} not found"))


async def _on_conflict(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Conflict)
    return error_response(ApiError(409, exc.code, exc.message))


async def _on_http(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such route, method not allowed) in the error shape."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    headers = dict(exc.headers or {})
    return error_response(ApiError(exc.status_code, code, exc.detail, headers=headers))


async def _on_internal(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(500, "internal", "an internal error; retry later"))


async def _on_idempotency(request: Request, exc: Exception) -> Response:
    return error_response(
        ApiError(
            422,
            "idempotency_key_reused",
            "this Idempotency-Key was used with a different request body",
            fields=[{"field": "Idempotency-Key", "message": "reused with another body"}],
        )
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
