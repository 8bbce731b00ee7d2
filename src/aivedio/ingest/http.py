"""The lean HTTP/1.1 path for ``POST /v1/callbacks/{provider}``: no ASGI, no router, no middleware.

:class:`CallbackServer` serves the same :class:`~aivedio.ingest.gateway.CallbackEndpoint` as the
ASGI route, on the shared port: the sniffer of :mod:`aivedio.process.http_server` reads the request
line of a connection and hands a ``POST /v1/callbacks/...`` to a :class:`CallbackProtocol`, which
parses with ``httptools`` (llhttp) and calls the endpoint's transport-independent steps
(``begin`` / ``finish``). What it does as the transport:

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

Message boundaries are found here, not by the parser, so a request handed back starts exactly
where the previous one ended: a head ends at the first blank line, a ``Content-Length`` body after
that many bytes, and a chunked body is fed to the parser a line at a time (it can only end just
after a line feed).
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

import httptools

from aivedio.ingest.gateway import CallbackEndpoint
from aivedio.ingest.http_connection import CallbackConnection, Reply, Slot
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
    requests and their route to the endpoint; the answering is :class:`CallbackConnection`'s."""

    def __init__(
        self,
        server: CallbackServer,
        transport: asyncio.Transport,
        handback: Callable[[bytes], None] | None,
        connections: set[Any] | None,
    ) -> None:
        super().__init__(server, transport, handback, connections)
        self.parser = httptools.HttpRequestParser(self)
        # the message being read
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_length = -1  # -1: none (then chunked, or no body)
        self.other_coding = False  # a transfer coding other than chunked alone
        self.expect_continue = False
        self.trace_header: bytes | None = None
        self.headers_done = False
        self.body: list[bytes] = []
        self.body_size = 0
        self.remaining = 0  # of a Content-Length body
        self.chunked = False
        self.complete = False
        self.head_started = False

    # -- httptools callbacks ------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))
        if len(name) in (6, 11, 14, 17):  # expect, traceparent, content-length, transfer-encoding
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                self.other_coding = self.other_coding or value.strip().lower() != b"chunked"
            elif lowered == b"content-length":
                self.content_length = int(value)  # llhttp checked the digits
            elif lowered == b"traceparent":
                self.trace_header = value
            elif lowered == b"expect":
                self.expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

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
        limit = self.server.head_limit
        end = buffer.find(b"\r\n\r\n", 0, limit)
        if end < 0:
            if len(buffer) >= limit:
                self._refuse_head(buffer)
            return False
        line_end = buffer.find(b"\r\n")
        parts = buffer[:line_end].split(b" ")
        if len(parts) != 3 or not parts[1].startswith(self.server.prefix):
            self._hand_back()
            return False
        self.head_started = False
        head = buffer[: end + 4]
        self.buffer = buffer[end + 4 :]
        self._reset_message()
        if not self._feed(head):
            return False
        if not self.headers_done:  # our blank line is not the parser's end of the head
            self._fail(400, self._provider_name())
            return False
        if self.other_coding:  # framing we would not decode (RFC 9112 6.1): refused, as h11 does
            self._fail(400, self._provider_name())
            return False
        self._begin()
        return not self.closing

    def _reset_message(self) -> None:
        self.url = b""
        self.raw_headers = []
        self.content_length = -1
        self.other_coding = False
        self.expect_continue = False
        self.trace_header = None
        self.headers_done = False
        self.body = []
        self.body_size = 0
        self.complete = False
        self.request = None

    def _feed(self, data: bytes) -> bool:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, self._provider_name())  # no protocol upgrades here
            return False
        except httptools.HttpParserError:
            self._fail(400, self._provider_name())
            return False
        return True

    def _path(self) -> tuple[str, bytes]:
        path, _, query = self.url.partition(b"?")
        name = path[len(self.server.prefix) :].decode("latin-1")
        return (unquote(name) if "%" in name else name), query

    def _provider_name(self) -> str:
        return self._path()[0] if self.url.startswith(self.server.prefix) else ""

    def _begin(self) -> None:
        trace_id = self._trace_id()
        name, query = self._path()
        method = self.parser.get_method().decode("ascii")
        has_body = not self.complete
        started = self.endpoint.begin(name, method, self.raw_headers, query, trace_id)
        if isinstance(started, Answer):
            if has_body and not started.close:  # its body is not read: the connection ends
                started = Answer(started.status, started.headers, started.body, close=True)
            self._answer_now(started, trace_id, method)
            return
        if not has_body:
            self._submit(started, b"", method)
            return
        self.request = started
        self.reading_body = True
        self.chunked = self.content_length < 0
        self.remaining = self.content_length
        if self.expect_continue and not self.pending:
            self.transport.write(_CONTINUE)

    def _read_body(self) -> bool:
        """Feed body bytes; False when more bytes are needed or reading stopped."""
        request = self.request
        assert request is not None
        buffer = self.buffer
        if not self.chunked:
            take = min(self.remaining, len(buffer))
            piece, self.buffer = (
                (buffer, b"")
                if take == len(buffer)
                else (
                    buffer[:take],
                    buffer[take:],
                )
            )
            self.remaining -= take
        else:  # a chunked body can only end just after a line feed: feed a line at a time
            newline = buffer.find(b"\n")
            cut = len(buffer) if newline < 0 else newline + 1
            piece, self.buffer = buffer[:cut], buffer[cut:]
        if not self._feed(piece):
            return False
        if self.body_size > request.max_body_bytes:  # stop here; the rest is never read
            self.reading_body = False
            self.request = None
            self._answer_now(self.endpoint.abort(request, 413), request.trace_id, "POST")
            return False
        if not self.complete:
            if not self.chunked and self.remaining == 0:
                self._fail(400, request.provider.name)  # the parser disagrees on the length
                return False
            return True
        self.reading_body = False
        self.request = None
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self._submit(request, body, "POST")
        return True

    def _trace_id(self) -> str:
        if self.trace_header is not None:
            match = _TRACEPARENT.match(self.trace_header)
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

    def _refuse_head(self, buffer: bytes) -> None:
        line_end = buffer.find(b"\r\n", 0, self.server.head_limit)
        target = buffer[:line_end].split(b" ")[1:2] if line_end >= 0 else []
        self._reset_message()
        if target:
            self.url = target[0]
        self._fail(431, self._provider_name())
