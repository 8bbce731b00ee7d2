"""Every use of uvicorn internals, in one place, with a probe that they exist.

The sniffer of ``http_server.py`` sits in front of uvicorn's own HTTP protocol and, between two
requests of a keep-alive connection, may take the socket away from it (for an SSE or WebSocket
stream, or the lean callback path). uvicorn documents none of what that needs:

* ``uvicorn.protocols.http.auto.AutoHTTPProtocol`` (httptools if installed, else h11) and its
  constructor's keywords ``config``, ``server_state``, ``app_state``, ``_loop``, the way
  ``uvicorn.Server`` builds a protocol per connection;
* ``uvicorn.server.ServerState`` and its ``connections`` set (graceful shutdown walks it);
* on the protocol: ``cycle`` (``response_complete``, ``more_body``) to see that it is between
  two requests, ``timeout_keep_alive_task`` to cancel before detaching it, and ``conn`` (the
  h11 implementation's ``h11.Connection``, both sides ``h11.IDLE``);
* ``uvicorn.Server.capture_signals``, the context manager ``http_server.QuietServer`` overrides (the
  process, not uvicorn, owns signals).

:func:`probe` (called by ``serve_http`` before uvicorn starts) checks every one of them on the
installed uvicorn and raises :class:`UvicornInternalsError` naming the uvicorn version and what is
missing; pyproject.toml pins uvicorn to the tested minor release. Widen the pin only after the
probe's test and the gateway's server tests passed on the new version.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any

import h11
import uvicorn

from aivedio.errors import AivedioError

__all__ = [
    "AutoHTTPProtocol",
    "ServerState",
    "UvicornInternalsError",
    "connections",
    "detach",
    "http_protocol",
    "idle",
    "missing_internals",
    "probe",
]

PINNED = ">=0.55,<0.56"  # pyproject.toml's range: the releases these internals were checked on


class UvicornInternalsError(AivedioError):
    """The installed uvicorn lacks an internal the lean SSE / WebSocket / callback path uses."""


def _refusal(missing: str) -> UvicornInternalsError:
    return UvicornInternalsError(
        f"uvicorn {uvicorn.__version__} lacks internals aivedio's HTTP front door uses: "
        f"{missing}; install the uvicorn version pyproject.toml pins (uvicorn{PINNED})"
    )


try:
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.server import ServerState
except ImportError as exc:  # a uvicorn that moved them: refuse to start, saying so
    raise _refusal(str(exc)) from exc

_CONSTRUCTOR = ("config", "server_state", "app_state", "_loop")
_PROTOCOL_ATTRIBUTES = ("cycle", "timeout_keep_alive_task")
_CYCLE_ATTRIBUTES = ("response_complete", "more_body")


def _assigned(function: Any) -> set[str]:
    """The attribute names a function's code stores or loads (``self.x = ...`` among them)."""
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


def missing_internals(protocol: type[Any] | None = None) -> list[str]:
    """The uvicorn internals this module uses that the installed uvicorn lacks (checked on
    ``protocol``, by default ``AutoHTTPProtocol``)."""
    protocol = AutoHTTPProtocol if protocol is None else protocol
    name = getattr(protocol, "__name__", repr(protocol))
    missing: list[str] = []
    try:
        parameters = set(inspect.signature(protocol.__init__).parameters)
    except (TypeError, ValueError):
        parameters = set()
    missing += [f"{name}.__init__({p}=)" for p in _CONSTRUCTOR if p not in parameters]
    init = _assigned(protocol.__init__)
    missing += [f"{name}().{a}" for a in _PROTOCOL_ATTRIBUTES if a not in init]
    module = sys.modules.get(protocol.__module__)
    cycle = getattr(module, "RequestResponseCycle", None)
    if cycle is None:
        missing.append(f"{protocol.__module__}.RequestResponseCycle")
    else:
        fields = _assigned(cycle.__init__)
        missing += [f"RequestResponseCycle().{a}" for a in _CYCLE_ATTRIBUTES if a not in fields]
    if getattr(module, "h11", None) is h11 and "conn" not in init:  # the h11 implementation
        missing.append(f"{name}().conn")
    if not isinstance(getattr(ServerState(), "connections", None), set):
        missing.append("ServerState().connections")
    if not callable(getattr(uvicorn.Server, "capture_signals", None)):
        missing.append("Server.capture_signals")
    return missing


def probe() -> None:
    """Check the internals (at start-up); raise ``UvicornInternalsError`` if one is missing."""
    missing = missing_internals()
    if missing:
        raise _refusal(", ".join(missing))


def http_protocol(
    protocol: type[asyncio.Protocol],
    config: uvicorn.Config,
    server_state: ServerState,
    app_state: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
) -> Any:
    """uvicorn's HTTP protocol for one connection, built as ``uvicorn.Server`` builds it."""
    return protocol(  # type: ignore[call-arg]
        config=config, server_state=server_state, app_state=app_state, _loop=loop
    )


def idle(protocol: Any) -> bool:
    """uvicorn's protocol is between requests: the next bytes start a new request."""
    cycle = getattr(protocol, "cycle", None)
    if cycle is not None and (not cycle.response_complete or cycle.more_body):
        return False
    conn = getattr(protocol, "conn", None)  # the h11 implementation
    if conn is not None and hasattr(conn, "their_state"):
        return bool(conn.their_state is h11.IDLE and conn.our_state is h11.IDLE)
    return True


def connections(server_state: ServerState) -> set[Any]:
    """The live connections uvicorn's graceful shutdown calls ``shutdown()`` on."""
    live: set[Any] = server_state.connections
    return live


def detach(protocol: Any, server_state: ServerState) -> None:
    """Take the socket away from uvicorn's protocol: its keep-alive timer would close a socket
    a stream now owns, and its shutdown would close it too."""
    keep_alive = getattr(protocol, "timeout_keep_alive_task", None)
    if keep_alive is not None:
        keep_alive.cancel()
        protocol.timeout_keep_alive_task = None
    server_state.connections.discard(protocol)
