"""The lean HTTP/1.1 path for ``POST /v1/callbacks/{provider}``: no ASGI, no router, no middleware.

:class:`CallbackServer` serves the same :class:`~aivedio.ingest.gateway.CallbackEndpoint` as the
ASGI route, on the shared port: the sniffer of :mod:`aivedio.gateway.server` reads the request
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
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from email.utils import formatdate
from typing import Any, cast
from urllib.parse import unquote

import httptools

from aivedio.ingest.gateway import NO_CONTENT, Answer, CallbackEndpoint, CallbackRequest
from aivedio.logs import log, trace_id_var

__all__ = ["CallbackProtocol", "CallbackServer"]

access_logger = logging.getLogger("aivedio.api")  # the ASGI path's request lines go there too

_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
_REASONS = {
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    415: b"Unsupported Media Type",
    422: b"Unprocessable Content",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}
_INTERNAL = Answer(
    500,
    (("content-type", "application/json"),),
    b'{"error": {"code": "internal", "message": "the callback could not be stored"}}',
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LINGER_S = 2.0
_LINGER_BYTES = 1 << 20
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


class _Slot:
    """One request's place in the answer order."""

    __slots__ = ("close", "data")

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.close = False


class _Reply:
    """Where one callback's answer goes: its slot in the answer order, then the connection.

    ``done`` is called with the answer once: at once for a rejection, or by the inbox writer
    after the row's batch committed (:meth:`CallbackEndpoint.finish_now`); for a verifier that
    may wait, :meth:`task_done` takes the answer of the ``finish`` task."""

    __slots__ = ("conn", "keep_alive", "method", "slot", "started", "trace_id")

    def __init__(
        self,
        conn: CallbackProtocol,
        slot: _Slot,
        trace_id: str,
        keep_alive: bool,
        method: str,
        started: float,
    ) -> None:
        self.conn = conn
        self.slot = slot
        self.trace_id = trace_id
        self.keep_alive = keep_alive
        self.method = method
        self.started = started

    def task_done(self, task: asyncio.Task[Answer]) -> None:
        try:
            answer = task.result()
        except (Exception, asyncio.CancelledError) as exc:
            self.failed(exc)  # cancelled at shutdown, or a bug
            return
        self.done(answer)

    def failed(self, exc: BaseException) -> None:
        """A bug on the way to the answer: 500, never a 2xx, and the answer order kept."""
        log(access_logger, logging.ERROR, "callback failed", error=type(exc).__name__)
        self.done(_INTERNAL)

    def done(self, answer: Answer) -> None:
        if self.slot.data is not None:  # answered already (a failure after the answer)
            return
        conn = self.conn
        conn._fill(self.slot, answer, self.trace_id, self.keep_alive, self.method, self.started)
        conn._flush()


class CallbackProtocol(asyncio.Protocol):
    """One connection on the lean callback path (see the module docstring)."""

    def __init__(
        self,
        server: CallbackServer,
        transport: asyncio.Transport,
        handback: Callable[[bytes], None] | None,
        connections: set[Any] | None,
    ) -> None:
        self.server = server
        self.endpoint = server.endpoint
        self.transport = transport
        self.handback = handback
        self.connections = connections
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.buffer = b""
        self.pending: deque[_Slot] = deque()
        # the message being read
        self.request: CallbackRequest | None = None
        self.url = b""
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
        self.keep_alive = True
        self.head_started = False
        self.started = 0.0  # when the current request's first bytes were taken up
        self.reading_body = False
        # the connection
        self.processing = False
        self.closing = False  # nothing more is read (answer what is pending, then close)
        self.closed = False
        self.close_after = False
        self.handing_back = False
        self.lingering = False
        self.linger_budget = _LINGER_BYTES
        self.reading_paused = False
        self.writing_paused = False
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        if connections is not None:
            connections.add(self)

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closing:
            if self.lingering:  # discarded; past the budget, the socket closes
                self.linger_budget -= len(data)
                if self.linger_budget < 0:
                    self._close()
            return
        self.buffer = self.buffer + data if self.buffer else data
        if self.handing_back:  # kept for the sniffer; no more until then
            self._pause_reading()
            return
        self._process()

    def eof_received(self) -> bool | None:
        if self.lingering:
            self._close()
            return None
        self._abandon_body()
        self.closing = True
        self._forget_timer()
        if self.pending:
            self.close_after = True
            return True  # half-closed: answer what was asked, then close
        self._forget()
        return None  # asyncio closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._abandon_body()
        self.closed = self.closing = True
        self._forget()
        # callbacks in flight are not cancelled: their rows commit (a retry is a duplicate)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._maybe_resume()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: answer what is in flight, read nothing more, close."""
        self._abandon_body()
        self.closing = True
        if self.pending:
            self.close_after = True
        else:
            self._close()

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

    def _abandon_body(self) -> None:
        """The client went away in the middle of a body: for the record (metric, log line)."""
        request = self.request
        if self.reading_body and request is not None and not self.closing:
            self.endpoint.abort(request, 499)
        self.reading_body = False
        self.request = None

    def _trace_id(self) -> str:
        if self.trace_header is not None:
            match = _TRACEPARENT.match(self.trace_header)
            if match:
                return "trc_" + match.group(1).decode("ascii")
        return _new_trace_id()

    # -- answering ----------------------------------------------------------------------------

    def _submit(self, request: CallbackRequest, body: bytes, method: str) -> None:
        slot = _Slot()
        self.pending.append(slot)
        reply = _Reply(self, slot, request.trace_id, self.keep_alive, method, self.started)
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

    def _answer_now(self, answer: Answer, trace_id: str, method: str) -> None:
        slot = _Slot()
        self.pending.append(slot)
        self._fill(slot, answer, trace_id, self.keep_alive, method, self.started)
        if slot.close:
            self.closing = True  # nothing after this request is read
            self._forget_timer()
        self._flush()

    def _fill(
        self,
        slot: _Slot,
        answer: Answer,
        trace_id: str,
        keep_alive: bool,
        method: str,
        started: float,
    ) -> None:
        close = answer.close or not keep_alive
        date = self.server.date()
        if answer is NO_CONTENT:
            slot.data = b"HTTP/1.1 204 No Content\r\ndate: %s\r\nx-trace-id: %s\r\n%s\r\n" % (
                date,
                trace_id.encode("ascii"),
                b"connection: close\r\n" if close else b"",
            )
        else:
            lines = [
                b"HTTP/1.1 %d %s\r\ndate: %s\r\nx-trace-id: %s\r\ncontent-length: %d\r\n"
                % (
                    answer.status,
                    _REASONS.get(answer.status, b"Error"),
                    date,
                    trace_id.encode("ascii"),
                    len(answer.body),
                )
            ]
            lines.extend(
                b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in answer.headers
            )
            if close:
                lines.append(b"connection: close\r\n")
            lines.append(b"\r\n")
            lines.append(answer.body)
            slot.data = b"".join(lines)
        slot.close = close
        # An accepted callback is logged at DEBUG: at INFO a line per callback was ~2 % of the
        # whole chain's CPU in bench e2e, and aivedio_callbacks_accepted_total counts them. A
        # refused one (forged, stale, too big, 503 ...) stays at INFO.
        level = logging.DEBUG if answer.status < 300 else logging.INFO
        if access_logger.isEnabledFor(level):
            log(
                access_logger,
                level,
                "request",
                method=method,
                path=self.url.partition(b"?")[0].decode("latin-1"),
                status=answer.status,
                ms=round((self.loop.time() - started) * 1000, 2),
                trace_id=trace_id,
            )

    def _flush(self) -> None:
        """Write the answers that are ready, in request order."""
        if self.closed:
            return
        pending = self.pending
        ready: list[bytes] = []
        close = False
        while pending and pending[0].data is not None:
            slot = pending.popleft()
            ready.append(cast(bytes, slot.data))
            if slot.close:
                close = True
                pending.clear()  # nothing after it was read
                break
        if ready:
            self.transport.write(ready[0] if len(ready) == 1 else b"".join(ready))
        if close:
            self._close(linger=True)
        elif not pending and self.close_after:
            self._close()
        elif not pending and self.handing_back:
            self._hand_back()
        elif not self.processing:
            self._maybe_resume()

    def _maybe_resume(self) -> None:
        if self.closing or self.handing_back or self.closed:
            return
        if self.writing_paused or len(self.pending) >= self.server.max_pipeline:
            return
        self._resume_reading()
        if self.buffer:
            self._process()
        else:
            self._set_deadline()

    # -- the connection -----------------------------------------------------------------------

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

    def _hand_back(self) -> None:
        """The next request is not a callback: once every answer before it is written, give the
        connection (and its bytes) back to the sniffer."""
        self.handing_back = True
        if self.pending:
            return
        self.closing = True
        data, self.buffer = self.buffer, b""
        self._forget()
        self._resume_reading()
        if self.handback is None:
            self.transport.write(
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
            self._close()
            return
        self.handback(data)

    def _pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def _close(self, linger: bool = False) -> None:
        """Close the connection. ``linger``: after an answer that ends it while the client may
        still be sending (a body not read), send FIN and discard what still arrives, for at most
        ``_LINGER_S`` and ``_LINGER_BYTES``, before closing: closing a socket with unread bytes
        sends a reset, which can destroy the answer before the client has read it."""
        self.closing = True
        self._forget()
        if self.closed:
            return
        if linger and not self.lingering and self.transport.can_write_eof():
            self.lingering = True
            self.transport.write_eof()
            self._resume_reading()
            self.timer = self.loop.call_later(_LINGER_S, self._close)
            return
        self.closed = True
        self.transport.close()

    def _forget(self) -> None:
        self._forget_timer()
        if self.connections is not None:
            self.connections.discard(self)

    def _forget_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.deadline = None

    # -- timeouts: one lazy timer per connection ----------------------------------------------

    def _set_deadline(self) -> None:
        if self.closing:
            return
        if self.reading_body or self.buffer:  # a request is arriving: read_timeout_s for it
            deadline: float | None = self.started + self.server.read_timeout_s
        elif self.pending:
            deadline = None  # waiting for the database, not for the client
        else:
            deadline = self.loop.time() + self.server.keep_alive_s
        self.deadline = deadline
        if deadline is not None and (self.timer is None or deadline < self.timer_at):
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = deadline
            self.timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        deadline = self.deadline
        if self.closing or deadline is None:
            return
        if self.loop.time() < deadline:  # moved later since: sleep again
            self.timer_at = deadline
            self.timer = self.loop.call_at(deadline, self._on_timer)
            return
        request = self.request
        if self.reading_body and request is not None:
            self.reading_body = False
            self.request = None
            self._answer_now(self.endpoint.abort(request, 408), request.trace_id, "POST")
        elif self.pending:  # a head that never completed, behind answers still to write
            self.closing = self.close_after = True
        else:
            self._close()  # idle keep-alive, or a head that never completed
