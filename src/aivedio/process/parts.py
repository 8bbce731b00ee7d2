"""What a role adds to a process: HTTP routes, named background loops, stop hooks.

A role module's factory (``async def <name>_role(rt: Runtime) -> RoleParts``) builds these;
``aivedio.roles`` composes them into one process (``RoleFactory`` is declared there). This module
imports no role module and not the runtime, so every role module can import it at module level.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.routing import BaseRoute

__all__ = ["Loop", "RoleLoop", "RoleParts"]

Loop = Callable[[asyncio.Event], Awaitable[None]]
"""A background loop: runs until the event (the process is stopping) is set."""


@dataclass(frozen=True, slots=True)
class RoleLoop:
    """A background loop and its name within its role (``consumer``, ``worker``): the supervisor
    restarts it, counts and reports it under (role, name)."""

    name: str
    run: Loop


@dataclass
class RoleParts:
    """What a role adds to the process: HTTP routes and named background loops."""

    routes: list[BaseRoute] = field(default_factory=list)
    loops: list[RoleLoop] = field(default_factory=list)
    http: bool = False
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run after the HTTP server and every loop have stopped (drain, close clients)."""
    gateway: object | None = None
    """The SSE and WebSocket gateway (an ``aivedio.gateway.Gateway``), served on the shared port
    by ``serve_http``. Typed ``object`` here so that this module, which every role imports,
    imports no role; ``aivedio.roles`` checks the type where it hands it on."""
