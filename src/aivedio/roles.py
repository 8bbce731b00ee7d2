"""``aivedio run --role ...``: run roles in one process.

HTTP roles (api, callbacks, gateway) contribute routes to one Starlette app on one port;
background roles contribute loops that run until the process is told to stop. Every role can
run in any number of processes at once: none keeps state that another replica needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute

from aivedio.api.app import create_app
from aivedio.config import Settings
from aivedio.gateway.server import serve_http
from aivedio.logs import log, setup_logging
from aivedio.runtime import Runtime, resolve_urls

if TYPE_CHECKING:
    from aivedio.gateway import Gateway
    from aivedio.providers.base import ProviderAdapter

logger = logging.getLogger("aivedio.roles")

Loop = Callable[[asyncio.Event], Awaitable[None]]


@dataclass
class RoleParts:
    """What a role adds to the process: HTTP routes and background loops."""

    routes: list[BaseRoute] = field(default_factory=list)
    loops: list[Loop] = field(default_factory=list)
    http: bool = False
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run after the HTTP server and every loop have stopped (drain, close clients)."""
    gateway: Gateway | None = None
    """The SSE gateway, served on the shared port by ``serve_http``."""


RoleFactory = Callable[[Runtime], Awaitable[RoleParts]]


async def _api(rt: Runtime) -> RoleParts:
    from aivedio.api.sessions import session_routes
    from aivedio.gateway import stream_token_routes
    from aivedio.media.role import playback_routes_for

    secret = rt.settings.derived_secret("stream-tokens")
    routes = stream_token_routes(rt.db, secret, rt.settings.stream_token_ttl_s)
    routes += session_routes(rt.db, rt.settings.public_url, rt.settings.session_ttl_s)
    from aivedio.web import web_routes

    return RoleParts(routes=[*routes, *playback_routes_for(rt), *web_routes()], http=True)


async def _gateway(rt: Runtime) -> RoleParts:
    from aivedio.gateway import Gateway

    return RoleParts(http=True, gateway=Gateway(rt.db, rt.settings.gateway(rt.urls.redis_url)))


async def _callbacks(rt: Runtime) -> RoleParts:
    from aivedio.ingest.role import callbacks_role

    return await callbacks_role(rt)


async def _inbox(rt: Runtime) -> RoleParts:
    from aivedio.ingest.processor import inbox_role

    return await inbox_role(rt)


async def _media(rt: Runtime) -> RoleParts:
    from aivedio.media.role import media_role

    return await media_role(rt)


async def _billing(rt: Runtime) -> RoleParts:
    from aivedio.billing.role import billing_role

    return await billing_role(rt)


async def _relay(rt: Runtime) -> RoleParts:
    from aivedio.propagation.roles import relay_role

    return await relay_role(rt)


async def _dispatcher(rt: Runtime) -> RoleParts:
    from aivedio.propagation.roles import dispatcher_role

    if rt.settings.fanout == "node":  # AIVEDIO_FANOUT=node: publish to interested nodes only
        from aivedio.gateway.routing import node_dispatcher_role

        return await node_dispatcher_role(rt)
    return await dispatcher_role(rt)


async def _poller(rt: Runtime) -> RoleParts:
    from aivedio.polling.role import poller_role

    return await poller_role(rt)


async def _with_adapters(
    rt: Runtime, loops_for: Callable[[dict[str, ProviderAdapter]], list[Loop]]
) -> RoleParts:
    from aivedio.providers.registry import build_providers, providers_config

    adapters = build_providers(providers_config(rt.settings))

    async def close() -> None:
        for adapter in adapters.values():
            await adapter.aclose()

    return RoleParts(loops=loops_for(adapters), on_stop=[close])


async def _submitter(rt: Runtime) -> RoleParts:
    from aivedio.submission.role import submitter_loops

    return await _with_adapters(rt, lambda a: submitter_loops(rt.db, rt.state, a))


async def _reconciler(rt: Runtime) -> RoleParts:
    from aivedio.submission.role import reconciler_loops

    return await _with_adapters(rt, lambda a: reconciler_loops(rt.db, rt.state, a))


# The roles this build has. The operator contract names more (see cli.ROLES); they are added here
# as they are built.
AVAILABLE: dict[str, RoleFactory] = {
    "api": _api,
    "callbacks": _callbacks,
    "inbox": _inbox,
    "gateway": _gateway,
    "submitter": _submitter,
    "poller": _poller,
    "relay": _relay,
    "dispatcher": _dispatcher,
    "media": _media,
    "billing": _billing,
    "reconciler": _reconciler,
}


def expand(roles: Sequence[str]) -> list[str]:
    if "all" in roles:
        return list(AVAILABLE)
    return list(dict.fromkeys(roles))


async def run_roles(settings: Settings, roles: Sequence[str], port: int | None = None) -> int:
    setup_logging(settings.log_level)
    wanted = expand(roles)
    missing = [r for r in wanted if r not in AVAILABLE]
    if missing:
        log(
            logger,
            logging.ERROR,
            "roles not available in this build",
            roles=missing,
            available=sorted(AVAILABLE),
        )
        return 2
    port = port or settings.port
    settings = settings.listening_on(port)
    rt = await Runtime.open(settings, resolve_urls(settings))
    try:
        return await serve(rt, wanted, port)
    finally:
        await rt.close()


async def serve(rt: Runtime, roles: Sequence[str], port: int) -> int:
    parts = [await AVAILABLE[name](rt) for name in roles]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)
    failed: list[BaseException] = []

    def watch(job: asyncio.Task[object]) -> None:
        # A role that ends by itself (crash, or a server that could not bind) stops the process:
        # a half-running process would look healthy while doing nothing.
        if not stopping.is_set():
            if not job.cancelled() and job.exception() is not None:
                failed.append(job.exception())  # type: ignore[arg-type]
                log(logger, logging.ERROR, "role stopped", error=repr(job.exception()))
            else:
                failed.append(RuntimeError("a role ended"))
            stopping.set()

    jobs: list[asyncio.Task[object]] = []

    def start(coro: Awaitable[object]) -> None:
        job = asyncio.ensure_future(coro)
        job.add_done_callback(watch)
        jobs.append(job)

    for p in parts:
        for fn in p.loops:
            start(fn(stopping))
    http = any(p.http for p in parts)
    if http:
        routes = [r for p in parts for r in p.routes]
        app = create_app(rt.db, rt.tasks, rt.settings.api, extra_routes=routes)
        gateway = next((p.gateway for p in parts if p.gateway is not None), None)
        start(
            serve_http(
                app, rt.settings.host, port, gateway, stopping, reuse_port=rt.settings.reuse_port
            )
        )
    log(logger, logging.INFO, "roles running", roles=list(roles), port=port if http else None)
    await stopping.wait()
    log(logger, logging.INFO, "stopping", roles=list(roles))
    await asyncio.gather(*jobs, return_exceptions=True)
    for part in parts:
        for hook in part.on_stop:
            try:
                await hook()
            except Exception as exc:  # one role's cleanup must not skip the others'
                log(logger, logging.ERROR, "cleanup failed", error=repr(exc))
    return 1 if failed else 0
