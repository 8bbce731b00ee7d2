"""The lean HTTP/1.1 path for ``POST /v1/callbacks/{provider}``: no ASGI, no router, no middleware.

:class:`CallbackServer` serves the same :class:`~aivedio.ingest.gateway.CallbackEndpoint` as the
ASGI route, on the shared port: the sniffer of :mod:`aivedio.process.http_server` reads the request
line of a connection and hands a ``POST /v1/callbacks/...`` to a :class:`CallbackProtocol`, which
frames requests with :mod:`aivedio.ingest.http_framing` and calls the endpoint's
transport-independent steps (``begin`` / ``finish``). What it does as the transport:

- keep-alive, and pipelined requests handled concurrently (their rows join one group commit) but
  answered in order; at most ``max_pipeline`` in flight per connection, then reading pauses;
- the head read up to a cap (``max_header_bytes + max_query_bytes + 1 KiB``), else 431 and close;
  the endpoint's own header count/size and query rules then apply (431, 414);
- the body read within the provider's ``max_body_bytes``: a ``Content-Length`` over it is answered
  413 before any of the body is read, a chunked body is counted as it arrives and reading stops at
  the limit (413); both with ``Connection: close``, the rest never read;
- the body must arrive within ``read_timeout_s`` of its head (408 and close); an idle keep-alive
  connection is closed after ``keep_alive_s``;
- a refusal decided on the head (404, 405, 415, 431, 414, 413) of a request that carries a body
  is answered with ``Connection: close`` (the body is not read at all);
- every answer has ``date`` and ``x-trace-id`` (from a valid ``traceparent``, else a new id), as
  the ASGI middleware gives; with the ``aivedio.api`` logger at INFO, one ``request`` line each;
- a request for anything else on the same connection (``GET /v1/tasks/...``, the SSE path) is
  handed back to the sniffer with its bytes once every callback before it was answered; the
  sniffer gives it to uvicorn's protocol or the SSE gateway, exactly as for a new connection.

Message boundaries are found by :class:`~aivedio.ingest.http_framing.RequestFramer`, a pure
module (bytes in, decisions out; httptools parses inside it), run here on the connection's
buffer: a request handed back starts exactly where the previous one ended. The same code is
checked against h11 on generated streams without a socket
(``tests/unit/test_http_framing_vs_h11.py``) and, end to end, over one
(``tests/integration/test_ingest_http_vs_h11.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

from aivedio.ingest.gateway import CallbackEndpoint
from aivedio.ingest.http_connection import CallbackConnection, Reply, Slot
from aivedio.ingest.http_framing import NOT_OURS, Refused, RequestFramer
from aivedio.ingest.messages import Answer, CallbackRequest
from aivedio.logs import trace_id_var

__all__ = ["CallbackProtocol", "CallbackServer"]

_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEAD_SLACK = 1024  # the request line and the blank lines, beyond the header and query limits
_trace_prefix = "trc_" + secrets.token_hex(8)
_trace_counter = itertools.count()


def _new_trace_id() -> str:
    """``trc_`` + 24 hex digits, like ``aivedio.logs.new_trace_id``: a random prefix per process
    and a counter (a trace id correlates, it is no secret; no syscall per request)."""
    global _trace_prefix
    n = next(_trace_counter) & 0xFFFFFFFF
    if n == 0xFFFFFFFF:  # the counter wraps: a new prefix keeps ids unique
        _trace_prefix = "trc_" + secrets.token_hex(8)
    return "%s%08x" % (_trace_prefix, n)  # noqa: UP031 - measured faster than the f-string


class CallbackServer:
    """What every callback connection of one server shares: the endpoint, the limits, the date.

    ``connections`` is where live connections register (uvicorn's ``server_state.connections``
    when the sniffer creates them, so uvicorn's graceful shutdown calls their ``shutdown()`` and
    waits for them).
    """

    def __init__(
        self,
        endpoint: CallbackEndpoint,
        *,
        keep_alive_s: float = 5.0,
        max_pipeline: int = 64,
    ) -> None:
        self.endpoint = endpoint
        config = endpoint.config
        if not config.path.endswith("{provider}") or config.path.count("{") != 1:
            raise ValueError("the callback path must end with {provider}")
        self.prefix = config.path.removesuffix("{provider}").encode("ascii")
        self.sniff = b"POST " + self.prefix
        """The first bytes of a connection the sniffer hands to this server."""
        self.head_limit = config.max_header_bytes + config.max_query_bytes + _HEAD_SLACK
        self.read_timeout_s = config.read_timeout_s
        self.keep_alive_s = keep_alive_s
        self.max_pipeline = max_pipeline
        self._date_second = -1
        self._date = b""

    def date(self) -> bytes:
        """The ``date`` header value, formatted once a second."""
        now = time.time()
        second = int(now)
        if second != self._date_second:
            self._date_second = second
            self._date = formatdate(now, usegmt=True).encode("ascii")
        return self._date

    def wants(self, request_line: tuple[str, str]) -> bool:
        """Whether the sniffer should hand a connection whose first request line is
        ``(method, target)`` to this server."""
        return request_line[0] == "POST" and request_line[1].startswith(self.prefix.decode())

    def connection(
        self,
        transport: asyncio.Transport,
        handback: Callable[[bytes], None] | None = None,
        connections: set[Any] | None = None,
    ) -> CallbackProtocol:
        """A protocol for ``transport`` (the caller makes it the transport's protocol and feeds
        it the bytes read so far). ``handback(data)`` takes the connection back, with the bytes
        of a request that is not a callback; without it such a request is answered 404."""
        return CallbackProtocol(self, transport, handback, connections)


class CallbackProtocol(CallbackConnection):
    """One connection on the lean callback path (see the module docstring): the reading of
    requests (framed by :class:`~aivedio.ingest.http_framing.RequestFramer`) and their route to
    the endpoint; the answering is :class:`CallbackConnection`'s."""

    def __init__(
        self,
        server: CallbackServer,
        transport: asyncio.Transport,
        handback: Callable[[bytes], None] | None,
        connections: set[Any] | None,
    ) -> None:
        super().__init__(server, transport, handback, connections)
        self.framer = RequestFramer(server.head_limit, server.prefix, note=b"traceparent")
        self.head_started = False

    # -- reading ------------------------------------------------------------------------------

    def _process(self) -> None:
        """Take as many requests (and body bytes) from the buffer as allowed."""
        if self.processing:
            return  # re-entered from an answer written inside the loop below
        self.processing = True
        try:
            while self.buffer and not (self.closing or self.handing_back):
                if self.reading_body:
                    if not self._read_body():
                        break
                    continue
                if len(self.pending) >= self.server.max_pipeline or self.writing_paused:
                    self._pause_reading()
                    break
                if not self._read_head():
                    break
        finally:
            self.processing = False
        self._set_deadline()

    def _read_head(self) -> bool:
        """Start the next request; False when more bytes are needed or reading stopped."""
        if not self.head_started:
            self.head_started = True
            self.started = self.loop.time()
        buffer = self.buffer
        framer = self.framer
        try:
            size = framer.read_head(buffer)
        except Refused as refusal:  # 431, 400
            self.url = framer.url
            self._fail(refusal.status, self._provider_name())
            return False
        if size <= 0:
            if size == NOT_OURS:
                self._hand_back()
            return False
        self.head_started = False
        self.buffer = buffer[size:]
        self.url = framer.url
        self.keep_alive = framer.keep_alive
        self._begin()
        return not self.closing

    def _path(self) -> tuple[str, bytes]:
        path, _, query = self.url.partition(b"?")
        name = path[len(self.server.prefix) :].decode("latin-1")
        return (unquote(name) if "%" in name else name), query

    def _provider_name(self) -> str:
        return self._path()[0] if self.url.startswith(self.server.prefix) else ""

    def _begin(self) -> None:
        framer = self.framer
        trace_id = self._trace_id()
        name, query = self._path()
        method = framer.method.decode("ascii")
        has_body = not framer.complete
        started = self.endpoint.begin(name, method, framer.headers, query, trace_id)
        if isinstance(started, Answer):
            if has_body and not started.close:  # its body is not read: the connection ends
                started = Answer(started.status, started.headers, started.body, close=True)
            self._answer_now(started, trace_id, method)
            return
        if not has_body:
            self._submit(started, b"", method)
            return
        try:
            framer.start_body(started.max_body_bytes)
        except Refused:  # 413 by Content-Length (which the endpoint's begin answers first)
            self._answer_now(self.endpoint.abort(started, 413), trace_id, method)
            return
        self.request = started
        self.reading_body = True
        if framer.expect_continue and not self.pending:
            self.transport.write(_CONTINUE)

    def _read_body(self) -> bool:
        """Feed body bytes; False when more bytes are needed or reading stopped."""
        request = self.request
        assert request is not None
        buffer = self.buffer
        framer = self.framer
        try:
            taken = framer.read_body(buffer)
        except Refused as refusal:
            if refusal.status != 413:
                self._fail(refusal.status, request.provider.name)
                return False
            self.reading_body = False  # past the limit: the rest is never read
            self.request = None
            self._answer_now(self.endpoint.abort(request, 413), request.trace_id, "POST")
            return False
        self.buffer = b"" if taken == len(buffer) else buffer[taken:]
        if not framer.complete:
            return True
        self.reading_body = False
        self.request = None
        self._submit(request, framer.take_body(), "POST")
        return True

    def _trace_id(self) -> str:
        trace_header = self.framer.noted
        if trace_header is not None:
            match = _TRACEPARENT.match(trace_header)
            if match:
                return "trc_" + match.group(1).decode("ascii")
        return _new_trace_id()

    # -- the callback route -------------------------------------------------------------------

    def _submit(self, request: CallbackRequest, body: bytes, method: str) -> None:
        slot = Slot()
        self.pending.append(slot)
        reply = Reply(self, slot, request.trace_id, self.keep_alive, method, self.started)
        try:
            if self.endpoint.finish_now(request, body, reply.done):
                return
        except Exception as exc:
            reply.failed(exc)
            return
        token = trace_id_var.set(request.trace_id)  # the task's log lines carry it
        try:
            task = self.loop.create_task(self.endpoint.finish(request, body))
        finally:
            trace_id_var.reset(token)
        task.add_done_callback(reply.task_done)

    def _fail(self, status: int, provider_name: str) -> None:
        """A request this transport cannot read on (malformed, past a cap): answer, close."""
        trace_id = self._trace_id()
        self.reading_body = False
        self.request = None
        answer = self.endpoint.refuse(provider_name, status, trace_id)
        self._answer_now(answer, trace_id, "")
