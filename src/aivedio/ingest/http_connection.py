"""The connection side of the lean callback path: answers written in request order, flow control,
closing (with linger), the hand-back to the sniffer and the timers.

:class:`CallbackConnection` is the base of :class:`aivedio.ingest.http.CallbackProtocol`, which
reads the requests (framed by :mod:`aivedio.ingest.http_framing`) and routes them to the
endpoint; this module knows nothing of parsing. The one call down is
:meth:`CallbackConnection._process`: take up buffered bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, cast

from aivedio.ingest.gateway import CallbackEndpoint
from aivedio.ingest.messages import NO_CONTENT, Answer, CallbackRequest
from aivedio.logs import log

__all__ = ["CallbackConnection", "Limits", "Reply", "Slot", "access_logger"]

access_logger = logging.getLogger("aivedio.api")  # the ASGI path's request lines go there too

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
_LINGER_S = 2.0
_LINGER_BYTES = 1 << 20


class Limits(Protocol):
    """What a connection reads of its :class:`~aivedio.ingest.http.CallbackServer`."""

    endpoint: CallbackEndpoint
    prefix: bytes
    head_limit: int
    read_timeout_s: float
    keep_alive_s: float
    max_pipeline: int

    def date(self) -> bytes: ...


class Slot:
    """One request's place in the answer order."""

    __slots__ = ("close", "data")

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.close = False


class Reply:
    """Where one callback's answer goes: its slot in the answer order, then the connection.

    ``done`` is called with the answer once: at once for a rejection, or by the inbox writer
    after the row's batch committed (:meth:`CallbackEndpoint.finish_now`); for a verifier that
    may wait, :meth:`task_done` takes the answer of the ``finish`` task."""

    __slots__ = ("conn", "keep_alive", "method", "slot", "started", "trace_id")

    def __init__(
        self,
        conn: CallbackConnection,
        slot: Slot,
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


class CallbackConnection(asyncio.Protocol):
    """One connection on the lean callback path, less the reading of requests (see
    :class:`aivedio.ingest.http.CallbackProtocol`)."""

    def __init__(
        self,
        server: Limits,
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
        self.buffer = b""
        self.pending: deque[Slot] = deque()
        # the request being read, as far as answering and the timers need it
        self.request: CallbackRequest | None = None
        self.url = b""
        self.keep_alive = True
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

    # -- reading (the subclass) ----------------------------------------------------------------

    def _process(self) -> None:
        """Take as many requests (and body bytes) from the buffer as allowed."""
        raise NotImplementedError

    def _abandon_body(self) -> None:
        """The client went away in the middle of a body: for the record (metric, log line)."""
        request = self.request
        if self.reading_body and request is not None and not self.closing:
            self.endpoint.abort(request, 499)
        self.reading_body = False
        self.request = None

    # -- answering ----------------------------------------------------------------------------

    def _answer_now(self, answer: Answer, trace_id: str, method: str) -> None:
        slot = Slot()
        self.pending.append(slot)
        self._fill(slot, answer, trace_id, self.keep_alive, method, self.started)
        if slot.close:
            self.closing = True  # nothing after this request is read
            self._forget_timer()
        self._flush()

    def _fill(
        self,
        slot: Slot,
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
