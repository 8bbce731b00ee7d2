"""One port for the ASGI app, the lean SSE path and the lean callback path.

uvicorn accepts a protocol *class* as ``Config(http=...)``. We give it ``SniffingProtocol``: it
reads the first request head of a connection; ``GET /v1/projects/{id}/events`` becomes an
``SseTransport`` and ``GET /v1/projects/{id}/ws`` a ``WsTransport`` owned by the gateway (no ASGI,
no task per connection; the gateway answers the upgrade), ``POST /v1/callbacks/{provider}`` a
``CallbackProtocol`` of :mod:`aivedio.ingest.http` (its own HTTP/1.1 keep-alive loop, which hands
the connection back here when a request for anything else follows), anything else is handed,
with the bytes already read, to uvicorn's own HTTP protocol (h11 or httptools) built with the same
config and server state, exactly as uvicorn's ``AutoZttpProtocol`` hands over after sniffing. So
uvicorn keeps everything it does (signals aside, which the process owns): Date headers, keep-alive,
graceful shutdown of ASGI connections. Every uvicorn internal this relies on is reached through
:mod:`aivedio.process.uvicorn_internals`, which ``serve_http`` probes before uvicorn starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Iterator
from typing import Any, Literal, cast

import uvicorn

from aivedio.gateway import frames
from aivedio.gateway.gateway import Gateway
from aivedio.gateway.protocol import PREFIX, is_events_target, is_ws_target, request_line
from aivedio.gateway.transport import SseTransport
from aivedio.gateway.websocket import WsTransport
from aivedio.ingest.gateway import find_callback_endpoint
from aivedio.ingest.http import CallbackServer
from aivedio.process import uvicorn_internals
from aivedio.process.uvicorn_internals import AutoHTTPProtocol, ServerState

DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_MAX_HEAD_BYTES = 8192


class SniffingProtocol(asyncio.Protocol):
    """Per connection: SSE requests to the gateway, callbacks to the callback server,
    everything else to uvicorn's protocol.

    For a connection that carries ASGI requests the sniffer stays in front of uvicorn's protocol
    as a thin forwarder, because a browser reuses a keep-alive connection: after a snapshot
    request it may send the SSE request on the same socket. Between two requests (uvicorn's
    cycle complete, nothing buffered) the next head is sniffed again; an SSE request then
    detaches uvicorn's protocol and the socket becomes an ``SseTransport``, a callback a
    ``CallbackProtocol`` (which gives the socket back, through :meth:`take_back`, at the first
    request that is not a callback). Either may be absent (``None``): a process with the
    callbacks role and no gateway still serves callbacks on the lean path.
    """

    gateway: Gateway | None = None
    callbacks: CallbackServer | None = None
    inner_class: type[asyncio.Protocol] = AutoHTTPProtocol

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = _loop or asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.inner: Any = None  # uvicorn's protocol, once a request went to the ASGI app
        self.buffer = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's ``TCPTransport`` is one without subclassing asyncio's).
        self.transport = cast(asyncio.Transport, transport)
        self._start_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            result: bool | None = self.inner.eof_received()
            return result
        return None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None and not self.buffer and not self._inner_idle():
            self.inner.data_received(data)  # the body or pipelined bytes of a request in flight
            return
        self.buffer += data
        buffer = self.buffer
        gateway, callbacks = self.gateway, self.callbacks
        if not (
            (gateway is not None and buffer.startswith(PREFIX[: len(buffer)]))
            or (callbacks is not None and buffer.startswith(callbacks.sniff[: len(buffer)]))
        ):
            self._to_asgi()  # neither the SSE nor the callback path: decided by the first bytes
            return
        line = request_line(buffer)
        if line is None:
            if len(buffer) > self._max_head_bytes():
                self._to_asgi()
            return
        if callbacks is not None and callbacks.wants(line):
            self._to_callbacks()
            return
        if gateway is None or not is_events_target(line[1]):
            self._to_asgi()
            return
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > gateway.config.max_head_bytes:
                self._reject_head()
            return
        self._to_gateway(gateway, buffer[: end + 4], buffer[end + 4 :], is_ws_target(line[1]))

    def _max_head_bytes(self) -> int:
        gateway = self.gateway
        return gateway.config.max_head_bytes if gateway is not None else DEFAULT_MAX_HEAD_BYTES

    def _start_timer(self) -> None:
        assert self.transport is not None
        gateway = self.gateway
        timeout = gateway.config.head_timeout_s if gateway is not None else DEFAULT_HEAD_TIMEOUT_S
        self.timer = self.loop.call_later(timeout, self.transport.close)

    def _inner_idle(self) -> bool:
        """uvicorn's protocol is between requests: the next bytes start a new request."""
        return uvicorn_internals.idle(self.inner)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _to_asgi(self) -> None:
        self._stop_timer()
        assert self.transport is not None
        if self.inner is None:
            self.inner = uvicorn_internals.http_protocol(
                self.inner_class, self.config, self.server_state, self.app_state, self.loop
            )
            self.inner.connection_made(self.transport)
        buffer, self.buffer = self.buffer, b""
        self.inner.data_received(buffer)

    def _detach_inner(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            uvicorn_internals.detach(inner, self.server_state)

    def _to_callbacks(self) -> None:
        self._stop_timer()
        self._detach_inner()
        assert self.transport is not None
        assert self.callbacks is not None
        protocol = self.callbacks.connection(
            self.transport, self.take_back, uvicorn_internals.connections(self.server_state)
        )
        self.transport.set_protocol(protocol)
        buffer, self.buffer = self.buffer, b""
        protocol.data_received(buffer)

    def take_back(self, data: bytes) -> None:
        """The callback protocol gives the connection back with the bytes of the next request,
        which is not a callback: sniff it as the first request of a new connection."""
        assert self.transport is not None
        self.transport.set_protocol(self)
        self._start_timer()
        self.data_received(data)

    def _to_gateway(self, gateway: Gateway, head: bytes, rest: bytes, websocket: bool) -> None:
        self._stop_timer()
        self._detach_inner()
        assert self.transport is not None
        config = gateway.config
        if config.socket_send_buffer is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_send_buffer)
        stream: SseTransport | WsTransport
        if websocket:
            stream = WsTransport(
                self.transport,
                config.write_high_water,
                config.write_low_water,
                config.ws_max_message,
                config.ws_close_timeout_s,
            )
            if rest:
                stream.data_received(rest)  # read after the upgrade
        else:
            stream = SseTransport(self.transport, config.write_high_water, config.write_low_water)
        self.transport.set_protocol(stream)
        self.buffer = b""
        gateway.accept(stream, head)

    def _reject_head(self) -> None:
        self._stop_timer()
        assert self.transport is not None
        self.transport.write(
            frames.error_response(431, "bad_request", "the request head is too large", {})
        )
        self.transport.close()


def protocol_class(
    gateway: Gateway | None, callbacks: CallbackServer | None = None
) -> type[SniffingProtocol]:
    """A ``SniffingProtocol`` bound to ``gateway`` and ``callbacks`` (either may be None), to
    pass as ``uvicorn.Config(http=...)``."""
    return type(
        "GatewaySniffingProtocol",
        (SniffingProtocol,),
        {"gateway": gateway, "callbacks": callbacks},
    )


class QuietServer(uvicorn.Server):
    """Leaves signal handling to the process (several roles share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def callback_server(app: Any, keep_alive_s: float = 5.0) -> CallbackServer | None:
    """The lean path for the callback endpoint mounted in ``app`` (``callback_routes``), if any:
    the same endpoint, so the same providers, limits and inbox writer as the ASGI route."""
    endpoint = find_callback_endpoint(app)
    return CallbackServer(endpoint, keep_alive_s=keep_alive_s) if endpoint is not None else None


def http_config(
    app: Any,
    host: str,
    port: int,
    gateway: Gateway | None,
    callbacks: CallbackServer | None = None,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's config for ``serve_http``; ``options`` add to or override its settings."""
    sniffing = gateway is not None or callbacks is not None
    settings: dict[str, Any] = {
        "http": protocol_class(gateway, callbacks) if sniffing else "auto",
        "lifespan": "off",
        "access_log": False,
        "log_config": None,
        "timeout_graceful_shutdown": 10,
    }
    return uvicorn.Config(app, host=host, port=port, **(settings | options))


async def serve_http(
    app: Any,
    host: str,
    port: int,
    gateway: Gateway | None,
    stopping: asyncio.Event,
    callbacks: CallbackServer | Literal["auto"] | None = "auto",
    *,
    reuse_port: bool = False,
    **options: Any,
) -> None:
    """Serve ``app``, the gateway's SSE path and the lean callback path on one port until
    ``stopping`` is set.

    ``reuse_port``: bind with ``SO_REUSEPORT``, so several processes serve the same port and the
    kernel spreads new connections over them (``AIVEDIO_REUSE_PORT``; one Python process uses one
    core: this is how the callback path uses the others).

    ``callbacks="auto"`` serves the callback endpoint mounted in ``app`` (by ``callback_routes``)
    on the lean path, when there is one; ``None`` leaves every callback to the ASGI route.
    ``options`` go to ``uvicorn.Config``.
    Starts the gateway's background work first; on stop, drains its streams (closing them with
    ``shutdown``, spread over ``drain_s``) before uvicorn's own graceful shutdown (which also
    lets callback connections answer what they read, then closes them).
    """
    uvicorn_internals.probe()  # a clear error now rather than a broken connection later
    if callbacks == "auto":
        callbacks = callback_server(app, float(options.get("timeout_keep_alive", 5)))
    config = http_config(app, host, port, gateway, callbacks, **options)
    server = QuietServer(config)
    sockets = [reuse_port_socket(host, port, config.backlog)] if reuse_port else None
    # Everything built so far (modules, the app, pools) lives as long as the process: out of the
    # collector's sight (after one last collection), a full collection no longer walks it; it
    # took ~70 ms with the app's modules loaded, a pause felt in the callbacks' P99.
    gc.collect()
    gc.freeze()
    try:
        await _serve(server, gateway, stopping, sockets)
    finally:
        gc.unfreeze()  # what was frozen may become garbage now (a process that serves again)
        for sock in sockets or ():
            sock.close()


def reuse_port_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on (host, port) with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``, as
    uvicorn binds), shared with every other process that binds it so."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _serve(
    server: QuietServer,
    gateway: Gateway | None,
    stopping: asyncio.Event,
    sockets: list[socket.socket] | None = None,
) -> None:
    if gateway is not None:
        await gateway.start()
    serving = asyncio.create_task(_serve_uvicorn(server, sockets))
    stop = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({serving, stop}, return_when=asyncio.FIRST_COMPLETED)
        if gateway is not None:
            await gateway.drain()
        server.should_exit = True
        await serving
    finally:
        stop.cancel()
        if not serving.done():
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        if gateway is not None:
            await gateway.close()


async def _serve_uvicorn(server: QuietServer, sockets: list[socket.socket] | None) -> None:
    try:
        await server.serve(sockets)
    except SystemExit as exc:
        # uvicorn's answer to a port it cannot bind (it logged why). Raised in a task, a
        # SystemExit would end the event loop at once, past every role's cleanup.
        raise OSError(f"the HTTP server could not start (uvicorn exit code {exc.code})") from None
