"""``transport.corked()``: frames given to lean transports inside are written at once on leaving,
one write per transport, in order, and a close inside flushes first."""

from __future__ import annotations

import asyncio
from typing import Any

from aivedio.gateway import frames
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.transport import SseTransport, corked


class SocketRecorder(asyncio.Transport):
    """What the event loop's transport was asked to do, call by call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, list_of_data: Any) -> None:
        self.calls.append(("writelines", [bytes(d) for d in list_of_data]))

    def close(self) -> None:
        self.calls.append(("close", None))

    def abort(self) -> None:
        self.calls.append(("abort", None))


def sse() -> tuple[SseTransport, SocketRecorder]:
    sock = SocketRecorder()
    return SseTransport(sock, 64 * 1024, 16 * 1024), sock


def test_outside_a_cork_every_frame_is_written_at_once() -> None:
    transport, sock = sse()
    transport.write(b"a")
    transport.write(b"b")
    assert sock.calls == [("write", b"a"), ("write", b"b")]


def test_inside_a_cork_frames_wait_and_leave_in_one_write_per_transport() -> None:
    (one, sock1), (two, sock2) = sse(), sse()
    with corked():
        one.write(b"e1")
        two.write(b"e1")
        one.write(b"e2")
        with corked():  # a nested cork joins the outer one
            one.write(b"e3")
        assert sock1.calls == [] and sock2.calls == []
    assert sock1.calls == [("writelines", [b"e1", b"e2", b"e3"])]
    assert sock2.calls == [("write", b"e1")]
    one.write(b"after")
    assert sock1.calls[-1] == ("write", b"after")


def test_a_close_inside_a_cork_writes_the_held_frames_first() -> None:
    transport, sock = sse()
    with corked():
        transport.write(b"e1")
        transport.close(CloseReason.SHUTDOWN)
        transport.write(b"late")  # after the close: never written
    close = frames.close_frame(
        CloseReason.SHUTDOWN.code, CloseReason.SHUTDOWN.label, CloseReason.SHUTDOWN.reconnect
    )
    assert sock.calls == [("write", b"e1"), ("write", close), ("close", None)]


def test_write_many_keeps_order_with_held_frames() -> None:
    transport, sock = sse()
    with corked():
        transport.write(b"e1")
        transport.write_many([b"r1", b"r2"])
    assert sock.calls == [("write", b"e1"), ("writelines", [b"r1", b"r2"])]
