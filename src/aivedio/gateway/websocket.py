"""``WsTransport``: the WebSocket endpoint as a second ``Transport`` on the lean path.

The sniffer (``process/http_server.py``) hands the socket over after the request head, exactly as
for SSE; the gateway checks Origin and credentials, then ``upgrade`` writes the 101 answer. From
then on this asyncio protocol speaks RFC 6455 itself (``wsframes.py``): text frames out, client
commands in.

Why not ``wsproto``: measured with tracemalloc on this machine (wsproto 1.3.2, 2,000 connections),
a ``wsproto.WSConnection`` holds about 4.6 KiB per connection after the handshake (an h11
connection, a frame decoder, a buffer, an event deque): more than the whole 4 KiB per-connection
budget of the gateway. This class, measured the same way, is 168 bytes per connection (an
``SseTransport`` is 72): one slotted object whose read buffer is ``b""`` between frames and whose
reassembly buffer exists only inside a fragmented message. The protocol subset it needs (masked
text frames of at most ``ws_max_message`` bytes, ping/pong, close, no extensions) is ~130 lines of
pure code in ``wsframes.py``, tested against the RFC's examples and by the ``websockets`` client.

One writer per connection: frames are written only from the event loop, synchronously, through
this transport (the session's ``deliver``/``tick`` and command replies), never from another task
or thread, so writes never interleave. Heartbeats come from the shared wheel: every visit checks
that something (a pong, any frame) arrived since the previous ping, else closes with
``ping_timeout``, then sends a new ping. So a client has one heartbeat period to answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from aivedio.gateway import frames, wsframes
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.frames import Event
from aivedio.gateway.session import Session
from aivedio.gateway.transport import SessionProtocol

CommandSink = Callable[[Session, str], None]


def ws_frame(event: Event) -> bytes:
    """The event's WebSocket text frame, encoded once per node and cached on the event."""
    frame = event.ws
    if frame is None:
        frame = event.ws = wsframes.text(frames.dumps(frames.ws_message(event)).encode())
    return frame


class WsTransport(SessionProtocol):
    __slots__ = (
        "_buffer",
        "_closing",
        "_fragments",
        "_open",
        "_ping_at",
        "_read_at",
        "close_timeout",
        "commands",
        "max_message",
    )
    kind = "ws"
    session: Session | None  # the base's slot, narrowed: commands are given the session itself

    def __init__(
        self,
        transport: asyncio.Transport,
        high_water: int,
        low_water: int,
        max_message: int,
        close_timeout: float,
    ) -> None:
        super().__init__(transport, high_water, low_water)
        self.commands: CommandSink | None = None
        self.max_message = max_message
        self.close_timeout = close_timeout
        self._open = False  # the 101 answer was written
        self._buffer = b""
        self._fragments: bytearray | None = None
        self._read_at = time.monotonic()
        self._ping_at: float | None = None
        self._closing: asyncio.TimerHandle | None = None

    # -- handshake -----------------------------------------------------------------------

    def upgrade(self, key: str, rest: bytes = b"") -> None:
        """Answer 101; bytes the client sent meanwhile are read now."""
        if self._closed:
            return
        self.transport.write(wsframes.handshake_response(key))
        self._open = True
        self._read_at = time.monotonic()
        if rest or self._buffer:
            self.data_received(rest)

    def reject(self, status: int, code: str, message: str, headers: dict[str, str]) -> None:
        """Answer a plain HTTP error before the upgrade (nothing else is ever written)."""
        if not self._closed:
            self._closed = True
            self.transport.write(frames.error_response(status, code, message, headers))
            self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._read_at = time.monotonic()  # any byte counts as activity (pongs included)
        buffer = self._buffer + data if self._buffer else data
        if not self._open:
            if len(buffer) > self.max_message + 14:  # a client may not send before the 101
                self.transport.abort()
            self._buffer = buffer
            return
        try:
            parsed, used = wsframes.parse_frames(buffer, self.max_message)
        except wsframes.Violation as exc:
            self._buffer = b""
            self._fail(exc.reason)
            return
        self._buffer = buffer[used:]
        for fin, opcode, payload in parsed:
            try:
                self._on_frame(fin, opcode, payload)
            except wsframes.Violation as exc:
                self._buffer = b""
                self._fail(exc.reason)
                return

    def _on_frame(self, fin: bool, opcode: int, payload: bytes) -> None:
        if opcode == wsframes.OP_CLOSE:
            self._on_close(payload)
        elif self._closed:
            return  # closing: only the client's close frame matters now
        elif opcode == wsframes.OP_PING:
            self.transport.write(wsframes.encode(wsframes.OP_PONG, payload))
        elif opcode == wsframes.OP_PONG:
            self._ping_at = None
        elif opcode == wsframes.OP_BINARY:
            raise wsframes.Violation(CloseReason.UNSUPPORTED_DATA, "binary messages")
        elif opcode == wsframes.OP_TEXT:
            if self._fragments is not None:
                raise wsframes.Violation(CloseReason.PROTOCOL_ERROR, "expected a continuation")
            if fin:
                self._on_message(payload)
            else:
                self._fragments = bytearray(payload)
        else:  # continuation
            if self._fragments is None:
                raise wsframes.Violation(CloseReason.PROTOCOL_ERROR, "nothing to continue")
            self._fragments += payload
            if len(self._fragments) > self.max_message:
                raise wsframes.Violation(CloseReason.MESSAGE_TOO_BIG, "message over the cap")
            if fin:
                message, self._fragments = bytes(self._fragments), None
                self._on_message(message)

    def _on_message(self, payload: bytes) -> None:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise wsframes.Violation(CloseReason.INVALID_DATA, "not UTF-8") from exc
        if self.session is not None and self.commands is not None:
            self.commands(self.session, text)

    def _on_close(self, payload: bytes) -> None:
        if self._closed:  # the client answers our close frame: the handshake is complete
            self._cancel_closing()
            self.transport.close()
            return
        code = wsframes.close_code(payload)
        self._closed = True
        self.transport.write(wsframes.close(1000 if code in (1005, 1006) else code))
        self.transport.close()
        session, self.session = self.session, None
        if session is not None:
            session.on_lost()  # logged as client_gone

    def _fail(self, reason: CloseReason) -> None:
        """The client broke the protocol: close with the RFC's code (logged by the session)."""
        self._fragments = None
        if self.session is not None:
            self.session.close(reason)  # calls self.close(reason)
        else:
            self.close(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_closing()
        super().connection_lost(exc)

    # -- Transport -----------------------------------------------------------------------

    def frame_of(self, event: Event) -> bytes:
        return ws_frame(event)

    def write(self, frame: bytes) -> None:
        if not self._closed:
            self.put(frame)

    def write_many(self, frames: Sequence[bytes]) -> None:
        if not self._closed and frames:
            self.flush_held()
            self.transport.writelines(frames)

    def ping(self, now: float, sse_ping: bytes) -> None:
        if not self._closed:
            self.transport.write(wsframes.PING)
            self._ping_at = now

    def overdue(self, now: float) -> CloseReason | None:
        """The previous ping (one wheel period ago) got no answer, nor anything else."""
        ping_at = self._ping_at
        if ping_at is not None and self._read_at < ping_at:
            return CloseReason.PING_TIMEOUT
        return None

    def close(self, reason: CloseReason) -> None:
        if self._closed:
            return
        self.flush_held()
        self._closed = True
        self.session = None
        if reason.abrupt or not self._open:
            self.transport.abort()
            return
        self.transport.write(wsframes.close(reason.ws_code, reason.label))
        if reason is CloseReason.SLOW:
            self.transport.abort()  # its buffer is full: waiting for it to drain would never end
            return
        # RFC 6455 §7.1.1: wait (briefly) for the client's close frame, then close TCP.
        loop = asyncio.get_running_loop()
        self._closing = loop.call_later(self.close_timeout, self.transport.abort)

    def _cancel_closing(self) -> None:
        if self._closing is not None:
            self._closing.cancel()
            self._closing = None
