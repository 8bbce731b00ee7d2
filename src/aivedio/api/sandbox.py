"""``GET/PUT /v1/sandbox/chaos``: the sandbox provider's chaos knobs for the web console, behind
the API's own credentials (the sandbox's key never reaches a browser). Mounted by the ``api`` role
only where the sandbox provider is enabled."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aivedio.api.auth import authenticate
from aivedio.api.http import ApiError, parse_body, read_json, respond
from aivedio.api.models import ChaosKnobs, ChaosPatch
from aivedio.db.pool import Database
from aivedio.logs import log

__all__ = ["SandboxChaos", "sandbox_routes"]

logger = logging.getLogger("aivedio.api")

SMALL_BODY = 4 * 1024


@dataclass(frozen=True, slots=True)
class SandboxChaos:
    """Where the sandbox provider is and its API key (``AIVEDIO_SANDBOX_URL``, ``..._API_KEY``)."""

    url: str
    api_key: str
    timeout_s: float = 5.0

    async def call(self, method: str, body: dict[str, object] | None = None) -> ChaosKnobs:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                answer = await http.request(
                    method,
                    self.url.rstrip("/") + "/_sandbox/chaos",
                    json=body,
                    headers={"Authorization": f"Bearer {self.api_key}"},
                )
        except httpx.HTTPError as exc:
            log(logger, logging.WARNING, "sandbox provider unreachable", error=repr(exc))
            raise _unavailable() from exc
        if answer.status_code == 422:
            message = _message(answer) or "invalid chaos knobs"
            raise ApiError(
                422,
                "validation_failed",
                "the request is invalid",
                fields=[{"field": "body", "message": str(message)}],
            )
        if answer.status_code != 200:
            log(logger, logging.WARNING, "sandbox provider refused", status=answer.status_code)
            raise _unavailable()
        try:
            return ChaosKnobs.model_validate(answer.json())
        except ValueError as exc:  # not JSON, or not the knobs: not a sandbox provider
            log(logger, logging.WARNING, "sandbox provider answered no knobs", error=repr(exc))
            raise _unavailable() from exc


def _message(answer: httpx.Response) -> str | None:
    """The sandbox's error message (``{"error": {"message"}}``), if it sent one."""
    try:
        body = answer.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else None


def _unavailable() -> ApiError:
    return ApiError(
        503,
        "sandbox_unavailable",
        "the sandbox provider did not answer; retry later",
        headers={"Retry-After": "2"},
    )


def sandbox_routes(db: Database, chaos: SandboxChaos) -> list[BaseRoute]:
    async def get(request: Request) -> Response:
        await authenticate(db, request)
        return respond(await chaos.call("GET"))

    async def put(request: Request) -> Response:
        await authenticate(db, request)
        patch = parse_body(ChaosPatch, await read_json(request, SMALL_BODY))
        return respond(await chaos.call("PUT", patch.model_dump(exclude_none=True)))

    return [
        Route("/v1/sandbox/chaos", get, methods=["GET"]),
        Route("/v1/sandbox/chaos", put, methods=["PUT"]),
    ]
