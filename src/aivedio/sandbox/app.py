"""The sandbox provider's HTTP surface: a Starlette app over one ``SandboxProvider``.

Protocol (DESIGN.md, "The sandbox provider protocol"): ``POST /v1/generations``,
``GET /v1/generations/{id}``, ``POST /v1/generations/{id}/cancel``; signed files at
``/files/{id}.mp4``; admin at ``/_sandbox/chaos``, ``/_sandbox/stats``, ``/_sandbox/reset``.
Errors are ``{"error": {"code": ..., "message": ...}}`` with stable codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aivedio.sandbox.chaos import ChaosError, apply_patch
from aivedio.sandbox.config import SandboxConfig
from aivedio.sandbox.media import CONTENT_TYPE
from aivedio.sandbox.provider import SandboxProvider
from aivedio.sandbox.simulation import RequestError, parse_create

MAX_KEY_LENGTH = 255
SERVER_ERRORS = (500, 502, 503)


def error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


class SandboxApi:
    """Request handlers; every ``/v1`` request goes through ``_admit`` (counters, cap, auth)."""

    def __init__(self, provider: SandboxProvider) -> None:
        self.provider = provider
        self.stats = provider.stats

    def _authorized(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.provider.config.api_key.encode()
        )

    def _admit(self, request: Request, endpoint: str, *, query: bool = False) -> Response | None:
        if not self.provider.started:
            return error(503, "sandbox_not_started", "Run the app's lifespan (see running()).")
        second = int(time.time())
        stats = self.stats
        stats.requests[endpoint] += 1
        stats.tick("requests", second)
        if query:
            stats.tick("queries", second)
        if not self.provider.rate_cap.admit(second):
            stats.requests["rejected_by_rate_cap"] += 1
            stats.tick("rejected", second)
            return error(429, "rate_limited", "Request rate cap exceeded.", {"Retry-After": "1"})
        stats.tick("served", second)
        if query:
            stats.tick("queries_served", second)
        if not self._authorized(request):
            return error(401, "unauthorized", "Missing or invalid API key.")
        return None

    def _admin(self, request: Request) -> Response | None:
        self.stats.requests["admin"] += 1
        if not self._authorized(request):
            return error(401, "unauthorized", "Missing or invalid API key.")
        return None

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def create(self, request: Request) -> Response:
        if (denied := self._admit(request, "create")) is not None:
            return denied
        key = request.headers.get("idempotency-key", "").strip()
        if not key or len(key) > MAX_KEY_LENGTH:
            return error(
                400, "idempotency_key_required", "An Idempotency-Key header (1..255) is required."
            )
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            return error(400, "invalid_json", "The body is not valid JSON.")
        try:
            parsed = parse_create(body)
        except RequestError as exc:
            return error(422, exc.code, exc.message)
        generation, created = await self.provider.create(key, parsed)
        headers = {} if created else {"Idempotent-Replayed": "true"}
        return JSONResponse({"id": generation.id, "status": generation.status}, headers=headers)

    async def lookup(self, request: Request) -> Response:
        """``GET /v1/generations?idempotency_key=K``: find a generation by its create key."""
        if (denied := self._admit(request, "lookup")) is not None:
            return denied
        key = request.query_params.get("idempotency_key", "")
        generation = self.provider.simulator.by_key.get(key)
        data = [] if generation is None else [self.provider.view(generation)]
        return JSONResponse({"data": data})

    async def query(self, request: Request) -> Response:
        if (denied := self._admit(request, "query", query=True)) is not None:
            return denied
        provider, counts = self.provider, self.stats.chaos
        chaos, dice = provider.chaos, provider.dice
        slow = dice.millis(chaos.query_slow_ms)
        if slow > 0:
            counts["query_slow"] += 1
            await asyncio.sleep(slow)
        if dice.roll(chaos.query_429_rate):
            counts["query_429"] += 1
            retry_after = str(math.ceil(chaos.retry_after_s))
            return error(429, "rate_limited", "Slow down.", {"Retry-After": retry_after})
        if dice.roll(chaos.query_5xx_rate):
            counts["query_5xx"] += 1
            status = dice.choice(SERVER_ERRORS)
            return error(status, "provider_unavailable", "The sandbox provider is having a moment.")
        generation = provider.simulator.generations.get(request.path_params["id"])
        if generation is None:
            return error(404, "not_found", "No such generation.")
        age = provider.scheduler.clock() - generation.created_mono
        if age < chaos.query_not_found_for_s:
            counts["query_404_young"] += 1
            return error(404, "not_found", "No such generation.")
        return JSONResponse(provider.view(generation))

    async def cancel(self, request: Request) -> Response:
        if (denied := self._admit(request, "cancel")) is not None:
            return denied
        generation = self.provider.simulator.generations.get(request.path_params["id"])
        if generation is None:
            return error(404, "not_found", "No such generation.")
        if not self.provider.cancel(generation):
            return error(409, "already_terminal", f"The generation is {generation.status}.")
        return JSONResponse({"id": generation.id, "status": generation.status}, 202)

    async def file(self, request: Request) -> Response:
        self.stats.requests["file"] += 1
        name: str = request.path_params["name"]
        generation_id = name.removesuffix(".mp4")
        params = request.query_params
        if name == generation_id or not self.provider.files.valid(
            generation_id, params.get("exp"), params.get("sig"), time.time()
        ):
            self.stats.requests["file_forbidden"] += 1
            return error(403, "forbidden", "The link is invalid or has expired.")
        generation = self.provider.simulator.generations.get(generation_id)
        if generation is None or generation.status != "succeeded":
            return error(404, "not_found", "No such file.")
        return Response(self.provider.video, media_type=CONTENT_TYPE)

    async def get_chaos(self, request: Request) -> Response:
        if (denied := self._admin(request)) is not None:
            return denied
        return JSONResponse(self.provider.chaos.to_json())

    async def put_chaos(self, request: Request) -> Response:
        if (denied := self._admin(request)) is not None:
            return denied
        try:
            patch: Any = json.loads(await request.body())
            self.provider.set_chaos(apply_patch(self.provider.chaos, patch))
        except ChaosError as exc:
            return error(422, "invalid_chaos", str(exc))
        except (ValueError, UnicodeDecodeError):
            return error(400, "invalid_json", "The body is not valid JSON.")
        return JSONResponse(self.provider.chaos.to_json())

    async def get_stats(self, request: Request) -> Response:
        if (denied := self._admin(request)) is not None:
            return denied
        keys = request.query_params.get("keys", "") in ("1", "true")
        delivered = request.query_params.get("delivered", "") in ("1", "true")
        return JSONResponse(self.provider.stats_json(keys=keys, delivered=delivered))

    async def reset(self, request: Request) -> Response:
        if (denied := self._admin(request)) is not None:
            return denied
        self.provider.reset()
        return JSONResponse({"chaos": self.provider.chaos.to_json()})


def create_app(config: SandboxConfig) -> Starlette:
    """The sandbox provider as an ASGI app; its simulation runs while the app's lifespan does."""
    provider = SandboxProvider(config)
    api = SandboxApi(provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await provider.start()
        try:
            yield
        finally:
            await provider.stop()

    routes = [
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/v1/generations", api.create, methods=["POST"]),
        Route("/v1/generations", api.lookup, methods=["GET"]),
        Route("/v1/generations/{id}", api.query, methods=["GET"]),
        Route("/v1/generations/{id}/cancel", api.cancel, methods=["POST"]),
        Route("/files/{name}", api.file, methods=["GET"]),
        Route("/_sandbox/chaos", api.get_chaos, methods=["GET"]),
        Route("/_sandbox/chaos", api.put_chaos, methods=["PUT"]),
        Route("/_sandbox/stats", api.get_stats, methods=["GET"]),
        Route("/_sandbox/reset", api.reset, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sandbox = provider
    return app


@contextlib.asynccontextmanager
async def running(app: Starlette) -> AsyncIterator[SandboxProvider]:
    """Run the app's lifespan without a server, e.g. around ``httpx.ASGITransport(app)``."""
    async with app.router.lifespan_context(app):
        provider: SandboxProvider = app.state.sandbox
        yield provider


async def serve(config: SandboxConfig, host: str, port: int) -> None:
    """Run the sandbox provider with uvicorn until the process is told to stop."""
    import uvicorn

    server_config = uvicorn.Config(
        create_app(config),
        host=host,
        port=port,
        lifespan="on",
        ws="none",
        access_log=False,
        log_level="warning",
    )
    await uvicorn.Server(server_config).serve()
