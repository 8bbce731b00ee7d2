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

from aivedio.api.app import create_app
from aivedio.api.sessions import session_routes
from aivedio.billing.role import billing_role
from aivedio.config import Settings
from aivedio.gateway import Gateway, stream_token_routes
from aivedio.gateway.routing import node_dispatcher_role
from aivedio.gateway.server import serve_http
from aivedio.ingest.processor import inbox_role
from aivedio.ingest.role import callbacks_role
from aivedio.logs import log, setup_logging
from aivedio.media.role import media_role, playback_routes_for
from aivedio.polling.role import poller_role
from aivedio.process.parts import Loop, RoleFactory, RoleParts
from aivedio.propagation.roles import dispatcher_role, relay_role
from aivedio.providers.base import ProviderAdapter
from aivedio.providers.registry import build_providers, providers_config
from aivedio.runtime import Runtime, resolve_urls
from aivedio.submission.role import reconciler_loops, submitter_loops
from aivedio.web import web_routes

__all__ = ["AVAILABLE", "expand", "run_roles", "serve"]

logger = logging.getLogger("aivedio.roles")


async def _api(rt: Runtime) -> RoleParts:
    secret = rt.settings.derived_secret("stream-tokens")
    routes = stream_token_routes(rt.db, secret, rt.settings.stream_token_ttl_s)
    routes += session_routes(rt.db, rt.settings.public_url, rt.settings.session_ttl_s)
    return RoleParts(routes=[*routes, *playback_routes_for(rt), *web_routes()], http=True)


async def _gateway(rt: Runtime) -> RoleParts:
    return RoleParts(http=True, gateway=Gateway(rt.db, rt.settings.gateway(rt.urls.redis_url)))


async def _dispatcher(rt: Runtime) -> RoleParts:
    if rt.settings.fanout == "node":  # AIVEDIO_FANOUT=node: publish to interested nodes only
        return await node_dispatcher_role(rt)
    return await dispatcher_role(rt)


async def _with_adapters(
    rt: Runtime, loops_for: Callable[[dict[str, ProviderAdapter]], list[Loop]]
) -> RoleParts:
    adapters = build_providers(providers_config(rt.settings))

    async def close() -> None:
        for adapter in adapters.values():
            await adapter.aclose()

    return RoleParts(loops=loops_for(adapters), on_stop=[close])


async def _submitter(rt: Runtime) -> RoleParts:
    return await _with_adapters(rt, lambda a: submitter_loops(rt.db, rt.state, a))


async def _reconciler(rt: Runtime) -> RoleParts:
    return await _with_adapters(rt, lambda a: reconciler_loops(rt.db, rt.state, a))


# The roles this build has. The operator contract names more (see cli.ROLES); they are added here
# as they are built.
AVAILABLE: dict[str, RoleFactory] = {
    "api": _api,
    "callbacks": callbacks_role,
    "inbox": inbox_role,
    "gateway": _gateway,
    "submitter": _submitter,
    "poller": poller_role,
    "relay": relay_role,
    "dispatcher": _dispatcher,
    "media": media_role,
    "billing": billing_role,
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
