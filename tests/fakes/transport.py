"""``RecordingTransport``: the ``Transport`` fake the session tests write to, no socket.

It passes the transport contract (``tests/contract/transport_contract.py``) that ``SseTransport``
and ``WsTransport`` pass over real sockets: frames are recorded in the order written (SSE
encoding, ``frame_of`` is the event's own frame), a write after ``close`` or after the peer went
away is dropped (and kept in ``refused``), ``close`` names its reason once. What a socket would
do is a method: :meth:`stall` (the send buffer filled: not writable, the session is told it
paused), :meth:`drain` (writable again) and :meth:`hang_up` (the peer went away). ``writable``
and ``late`` (what ``overdue`` answers) are also settable directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.frames import Event
from aivedio.gateway.transport import SessionEvents


class RecordingTransport:
    kind = "test"

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.refused: list[bytes] = []  # written after close / after the peer left: dropped
        self.closed: CloseReason | None = None
        self.lost = False  # the peer went away (hang_up)
        self.late: CloseReason | None = None
        self.session: SessionEvents | None = None
        self._paused = False

    @property
    def writable(self) -> bool:
        return not self._paused and self.closed is None and not self.lost

    @writable.setter
    def writable(self, value: bool) -> None:
        self._paused = not value

    def ping(self, now: float, sse_ping: bytes) -> None:
        self.write(sse_ping)

    def overdue(self, now: float) -> CloseReason | None:
        return self.late

    def frame_of(self, event: Event) -> bytes:
        return event.frame

    def write(self, frame: bytes) -> None:
        if self.closed is not None or self.lost:
            self.refused.append(frame)
        else:
            self.frames.append(frame)

    def write_many(self, frames: Sequence[bytes]) -> None:
        for frame in frames:
            self.write(frame)

    def close(self, reason: CloseReason) -> None:
        if self.closed is None and not self.lost:
            self.closed = reason
            self.session = None

    # -- what the socket would do ------------------------------------------------------

    def stall(self) -> None:
        self._paused = True
        if self.session is not None:
            self.session.on_paused()

    def drain(self) -> None:
        self._paused = False
        if self.session is not None:
            self.session.on_writable()

    def hang_up(self) -> None:
        if self.closed is None and not self.lost:
            self.lost = True
            session, self.session = self.session, None
            if session is not None:
                session.on_lost()
