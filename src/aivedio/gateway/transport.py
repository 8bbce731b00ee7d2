"""``Transport``: what a session writes to. SSE here; WebSocket in ``websocket.py``.

A transport is deliberately small: pick its encoding of an event, write one pre-encoded frame,
write many, ping, say whether the peer is overdue, close with a named reason, say whether the
socket is writable. The session logic (ordering, filtering, queueing, timers) lives in
``session.py`` and is tested against ``tests/fakes/transport.py``'s ``RecordingTransport``
without sockets. ``tests/contract/transport_contract.py`` is what the port promises: SSE and
WebSocket over real sockets and the fake pass it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

from aivedio.gateway import frames
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.frames import Event


class Transport(Protocol):
    kind: str  # the metrics / log label: "sse", "ws"

    @property
    def writable(self) -> bool: ...

    def frame_of(self, event: Event) -> bytes: ...

    def write(self, frame: bytes) -> None: ...

    def write_many(self, frames: Sequence[bytes]) -> None: ...

    def ping(self, now: float, sse_ping: bytes) -> None:
        """A heartbeat (from the shared wheel; ``sse_ping`` is the tick's SSE comment)."""

    def overdue(self, now: float) -> CloseReason | None:
        """Why the peer must be closed now (a missing pong), or ``None``."""

    def close(self, reason: CloseReason) -> None: ...


_held: list[SessionProtocol] | None = None  # the transports holding frames inside ``corked()``


@contextlib.contextmanager
def corked() -> Iterator[None]:
    """Inside, lean transports hold the frames they are given; on leaving, each writes what it
    holds at once (one ``writelines``: one syscall instead of one per frame).

    The hub delivers several Redis messages inside one ``corked()`` only when they had already
    arrived (it fell behind), so this adds no latency: it turns N sends per connection into one
    exactly when sends are the bottleneck. Synchronous code only (no await inside), so there is
    never more than one cork per process; a nested ``corked()`` joins the outer one.
    """
    global _held
    if _held is not None:
        yield
        return
    _held = []
    try:
        yield
    finally:
        held, _held = _held, None
        for transport in held:
            transport.flush_held()


class SessionEvents(Protocol):
    """What a transport tells its session (``session.Session``) about the socket."""

    def on_lost(self) -> None: ...
    def on_paused(self) -> None: ...
    def on_writable(self) -> None: ...
    def close(self, reason: CloseReason) -> None: ...


class SessionProtocol(asyncio.Protocol):
    """What every lean transport shares: the asyncio side of flow control, wired to its session.

    The socket's write buffer is bounded (``high_water`` / ``low_water``); when it fills, the
    session queues (bounded too) and evicts a client that stays slow.
    """

    __slots__ = ("_closed", "_held", "_paused", "session", "transport")

    def __init__(self, transport: asyncio.Transport, high_water: int, low_water: int) -> None:
        self.transport = transport
        self.session: SessionEvents | None = None
        self._paused = False
        self._closed = False
        self._held: list[bytes] | None = None  # frames written inside ``corked()``
        transport.set_write_buffer_limits(high=high_water, low=low_water)

    def put(self, frame: bytes) -> None:
        """Write ``frame`` now, or hold it until the current ``corked()`` ends."""
        if _held is None:
            self.transport.write(frame)
        elif self._held is None:
            self._held = [frame]
            _held.append(self)
        else:
            self._held.append(frame)

    def flush_held(self) -> None:
        """Write what ``corked()`` held (before a close frame, too: order is kept)."""
        frames_, self._held = self._held, None
        if frames_ and not self._closed:
            if len(frames_) == 1:
                self.transport.write(frames_[0])
            else:
                self.transport.writelines(frames_)

    def eof_received(self) -> bool:
        return False  # the client half-closed: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        session, self.session = self.session, None
        if session is not None:
            session.on_lost()

    def pause_writing(self) -> None:
        self._paused = True
        if self.session is not None:
            self.session.on_paused()

    def resume_writing(self) -> None:
        self._paused = False
        if self.session is not None:
            self.session.on_writable()

    @property
    def writable(self) -> bool:
        return not self._paused and not self._closed


class SseTransport(SessionProtocol):
    """One SSE connection: an asyncio protocol with small buffers, no task of its own."""

    __slots__ = ()
    kind = "sse"

    # -- asyncio.Protocol (the sniffer calls connection_made before handing over) ---------

    def data_received(self, data: bytes) -> None:
        """A client sends nothing after its request head; bytes are ignored."""

    # -- Transport -----------------------------------------------------------------------

    def frame_of(self, event: Event) -> bytes:
        return event.frame

    def write(self, frame: bytes) -> None:
        if not self._closed:
            self.put(frame)

    def write_many(self, frames: Sequence[bytes]) -> None:
        if not self._closed and frames:
            self.flush_held()
            self.transport.writelines(frames)

    def ping(self, now: float, sse_ping: bytes) -> None:
        self.write(sse_ping)

    def overdue(self, now: float) -> CloseReason | None:
        return None  # an SSE client sends nothing; a dead one shows as a stalled socket

    def begin(self, retry_ms: int) -> None:
        """The response head and the ``retry:`` hint: the stream is open."""
        self.write_many([frames.RESPONSE_HEAD, frames.retry_frame(retry_ms)])

    def close(self, reason: CloseReason) -> None:
        if self._closed:
            return
        self.flush_held()
        self._closed = True
        self.session = None
        if reason.abrupt:
            self.transport.abort()
            return
        self.transport.write(frames.close_frame(reason.code, reason.label, reason.reconnect))
        if reason is CloseReason.SLOW:
            self.transport.abort()  # its buffer is full: waiting for it to drain would never end
        else:
            self.transport.close()

    def reject(self, status: int, code: str, message: str, headers: dict[str, str]) -> None:
        """Answer a plain HTTP error before the stream started, and close."""
        if not self._closed:
            self._closed = True
            self.transport.write(frames.error_response(status, code, message, headers))
            self.transport.close()
