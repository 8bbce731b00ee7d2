"""``aivedio run --role ...``: run roles in one process.

HTTP roles (api, callbacks, gateway) contribute routes to one Starlette app on one port;
background roles contribute named loops that run, each under a supervisor that restarts it when
it fails, until the process is told to stop. Every role can run in any number of processes at
once: none keeps state that another replica needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from starlette.applications import Starlette

from aivedio.api.app import create_app
from aivedio.api.sandbox import SandboxChaos, sandbox_routes
from aivedio.api.sessions import session_routes
from aivedio.billing.role import billing_role
from aivedio.config import Settings
from aivedio.errors import ConfigError, DatabaseUnavailable
from aivedio.gateway import Gateway, stream_token_routes
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.outage import stream_outage_routes
from aivedio.ingest.role import callbacks_role, inbox_role
from aivedio.logs import log, setup_logging
from aivedio.media.role import media_role, playback_routes_for
from aivedio.polling.role import poller_role
from aivedio.process.http_server import serve_http
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.process.restart import RestartPolicy, restart_delay
from aivedio.process.supervisor import supervise
from aivedio.propagation.roles import dispatcher_role, relay_role
from aivedio.propagation.routing import node_dispatcher_role
from aivedio.providers.port import ProviderAdapter
from aivedio.providers.registry import build_providers, providers_config
from aivedio.reconcile.role import reconciler_loops
from aivedio.retention.role import maintenance_role
from aivedio.runtime import Runtime, resolve_urls
from aivedio.services.embedded import ServiceUrls
from aivedio.submission.config import CancelConfig, SubmitterConfig
from aivedio.submission.role import submitter_loops
from aivedio.web import web_routes

__all__ = ["AVAILABLE", "expand", "open_runtime", "run_roles", "serve", "stop_on_signals"]

logger = logging.getLogger("aivedio.roles")

RoleFactory = Callable[[Runtime], Awaitable[RoleParts]]
"""A role module's factory: ``async def <name>_role(rt: Runtime) -> RoleParts``."""


async def _api(rt: Runtime) -> RoleParts:
    secret = rt.settings.derived_secret("stream-tokens")
    routes = stream_token_routes(rt.db, secret, rt.settings.stream_token_ttl_s)
    routes += session_routes(rt.db, rt.settings.public_url, rt.settings.session_ttl_s)
    if rt.settings.sandbox_enabled:  # the console's chaos panel
        chaos = SandboxChaos(rt.settings.sandbox_url, rt.settings.sandbox_api_key)
        routes += sandbox_routes(rt.db, chaos)
    return RoleParts(
        routes=[
            *routes,
            *playback_routes_for(rt),
            *web_routes(sandbox=rt.settings.sandbox_enabled),
        ],
        http=True,
    )


async def _gateway(rt: Runtime) -> RoleParts:
    gateway = Gateway(
        rt.db, GatewayConfig.from_settings(rt.settings, rt.urls.redis_url), health=rt.health
    )
    routes = stream_outage_routes(rt.db, gateway.kill) if rt.settings.sandbox_enabled else []
    return RoleParts(routes=routes, http=True, gateway=gateway)


async def _dispatcher(rt: Runtime) -> RoleParts:
    if rt.settings.fanout == "node":  # AIVEDIO_FANOUT=node: publish to interested nodes only
        return await node_dispatcher_role(rt)
    return await dispatcher_role(rt)


async def _with_adapters(
    rt: Runtime, loops_for: Callable[[dict[str, ProviderAdapter]], list[RoleLoop]]
) -> RoleParts:
    adapters = build_providers(providers_config(rt.settings))

    async def close() -> None:
        for adapter in adapters.values():
            await adapter.aclose()

    return RoleParts(loops=loops_for(adapters), on_stop=[close])


async def _submitter(rt: Runtime) -> RoleParts:
    submit = SubmitterConfig(lease_s=rt.settings.submit_lease_s)
    cancel = CancelConfig(lease_s=rt.settings.cancel_lease_s)
    return await _with_adapters(rt, lambda a: submitter_loops(rt.db, rt.state, a, submit, cancel))


async def _reconciler(rt: Runtime) -> RoleParts:
    return await _with_adapters(rt, lambda a: reconciler_loops(rt.db, rt.state, a))


# The roles this build has. The operator contract names more (see cli.serving.ROLES); they are
# added here as they are built.
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
    "maintenance": maintenance_role,
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
    stopping = stop_on_signals()
    rt = await open_runtime(settings, resolve_urls(settings), stopping)
    if rt is None:  # a signal while waiting for the database
        return 0
    try:
        return await serve(rt, wanted, port, stopping)
    finally:
        await rt.close()


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT and SIGTERM set (the only way, besides a configuration error, that
    a process running roles ends)."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)
    return stopping


async def open_runtime(
    settings: Settings,
    urls: ServiceUrls,
    stopping: asyncio.Event,
    policy: RestartPolicy | None = None,
) -> Runtime | None:
    """``Runtime.open``, retried with backoff while PostgreSQL is away: a process started during
    a database outage waits for it instead of exiting. ``None`` if ``stopping`` came first."""
    policy = policy or RestartPolicy(cap_s=10.0)
    failures = 0
    while not stopping.is_set():
        try:
            return await Runtime.open(settings, urls)
        except DatabaseUnavailable as exc:
            failures += 1
            delay = restart_delay(failures, policy, random.random())
            log(
                logger,
                logging.WARNING,
                "database unavailable at start; waiting for it",
                error=str(exc),
                retry_in_s=round(delay, 3),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
    return None


async def serve(
    rt: Runtime,
    roles: Sequence[str],
    port: int,
    stopping: asyncio.Event | None = None,
    policy: RestartPolicy | None = None,
) -> int:
    """Run the roles until ``stopping`` is set (by SIGINT / SIGTERM when not given).

    Every loop runs under :func:`~aivedio.process.supervisor.supervise`: a loop that fails is
    restarted with backoff and reported on ``/readyz``; it never stops the process. What does:
    a signal (exit code 0), a :class:`ConfigError` from a loop or an HTTP port that cannot be
    bound (raised after the other roles stopped; the CLI exits with 2), or the HTTP server
    ending by itself (1). ``policy``: the restart backoff of every loop.
    """
    parts = {name: await AVAILABLE[name](rt) for name in roles}
    if stopping is None:
        stopping = stop_on_signals()
    jobs = _Jobs(stopping)
    for role, p in parts.items():
        for named in p.loops:
            unit = rt.health.unit(role, named.name)
            jobs.start(f"{role}/{named.name}", supervise(unit, named.run, stopping, policy))
    http = any(p.http for p in parts.values())
    if http:
        routes = [r for p in parts.values() for r in p.routes]
        app = create_app(rt.db, rt.tasks, rt.settings.api, extra_routes=routes, health=rt.health)
        gateway = next((p.gateway for p in parts.values() if isinstance(p.gateway, Gateway)), None)
        jobs.start("http", _serve_http(rt, app, port, gateway, stopping))
    log(logger, logging.INFO, "roles running", roles=list(roles), port=port if http else None)
    await stopping.wait()
    log(logger, logging.INFO, "stopping", roles=list(roles))
    await jobs.finished()
    for part in parts.values():
        for hook in part.on_stop:
            try:
                await hook()
            except Exception as exc:  # one role's cleanup must not skip the others'
                log(logger, logging.ERROR, "cleanup failed", error=repr(exc))
    config_errors = [e for e in jobs.fatal if isinstance(e, ConfigError)]
    if config_errors:
        raise config_errors[0]
    return 1 if jobs.fatal else 0


class _Jobs:
    """The process's jobs: its supervised loops and its HTTP server. They end only when the
    process stops; one that ends before (a ConfigError, the HTTP server) stops the process."""

    def __init__(self, stopping: asyncio.Event) -> None:
        self.stopping = stopping
        self.tasks: list[asyncio.Task[None]] = []
        self.fatal: list[BaseException] = []

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        job = asyncio.create_task(coro, name=name)
        job.add_done_callback(self._ended)
        self.tasks.append(job)

    async def finished(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _ended(self, job: asyncio.Task[None]) -> None:
        error = None if job.cancelled() else job.exception()
        if self.stopping.is_set():
            if error is not None:
                log(
                    logger,
                    logging.WARNING,
                    "error while stopping",
                    job=job.get_name(),
                    error=repr(error),
                )
            return
        error = error or RuntimeError(f"{job.get_name()} ended")
        log(logger, logging.ERROR, "stopping the process", job=job.get_name(), error=repr(error))
        self.fatal.append(error)
        self.stopping.set()


async def _serve_http(
    rt: Runtime, app: Starlette, port: int, gateway: Gateway | None, stopping: asyncio.Event
) -> None:
    host = rt.settings.host
    try:
        await serve_http(app, host, port, gateway, stopping, reuse_port=rt.settings.reuse_port)
    except OSError as exc:  # the port cannot be bound (in use, not ours, no such address)
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {reason}") from exc
    if not stopping.is_set():
        raise RuntimeError("the HTTP server stopped by itself")
