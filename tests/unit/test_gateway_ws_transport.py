"""``WsTransport`` against a fake asyncio transport: buffering before the upgrade, reassembly,
ping/pong, the close handshake, protocol violations and the missing-pong deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aivedio.gateway import wsframes
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.session import Identity, Session
from aivedio.gateway.websocket import WsTransport
from tests.unit.test_gateway_ws_codec import KEY, client_frame
from tests.waiting import eventually


class FakeSocket(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = b""
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.out += bytes(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        opcode, n = data[pos] & 0x0F, data[pos + 1] & 0x7F
        assert not data[pos + 1] & 0x80  # server frames are never masked
        pos += 2
        if n == 126:
            n, pos = int.from_bytes(data[pos : pos + 2], "big"), pos + 2
        out.append((opcode, data[pos : pos + n]))
        pos += n
    return out


class Owner:
    def __init__(self) -> None:
        self.forgotten: list[CloseReason] = []
        self.commands: list[str] = []

    def forget(self, session: Session, reason: CloseReason) -> None:
        self.forgotten.append(reason)

    def command(self, session: Session, text: str) -> None:
        self.commands.append(text)


def opened(max_message: int = 4096) -> tuple[WsTransport, FakeSocket, Owner, Session]:
    sock = FakeSocket()
    ws = WsTransport(sock, 1 << 15, 1 << 13, max_message, 0.1)
    owner = Owner()
    ident = Identity(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    config = GatewayConfig(redis_url="redis://unused")
    session = Session(ws, owner, config, uuid.uuid4(), ident, None, 1e18)
    ws.session = session
    ws.commands = owner.command
    return ws, sock, owner, session


def after_handshake(sock: FakeSocket) -> list[tuple[int, bytes]]:
    head, _, rest = sock.out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 ")
    return server_frames(rest)


async def test_bytes_before_the_upgrade_are_read_after_it_and_fragments_reassemble() -> None:
    ws, sock, owner, _ = opened()
    ws.data_received(client_frame(wsframes.OP_TEXT, b'{"a":', fin=False))
    assert owner.commands == []
    ws.upgrade(KEY)
    ws.data_received(client_frame(wsframes.OP_PING, b"hb"))  # a control frame between fragments
    more = client_frame(wsframes.OP_CONTINUATION, b"1}", fin=False)
    ws.data_received(more[:3])
    ws.data_received(more[3:])
    assert owner.commands == []  # the continuation was not final
    ws.data_received(client_frame(wsframes.OP_CONTINUATION, b"", fin=True))
    assert owner.commands == ['{"a":1}']
    assert after_handshake(sock) == [(wsframes.OP_PONG, b"hb")]


async def test_client_close_is_answered_and_logged_as_client_gone() -> None:
    ws, sock, owner, session = opened()
    ws.upgrade(KEY)
    ws.data_received(client_frame(wsframes.OP_CLOSE, (1000).to_bytes(2, "big") + b"bye"))
    assert after_handshake(sock) == [(wsframes.OP_CLOSE, (1000).to_bytes(2, "big"))]
    assert sock.closed
    assert owner.forgotten == [CloseReason.CLIENT_GONE]
    assert session.closed is CloseReason.CLIENT_GONE


async def test_server_close_waits_for_the_clients_close_frame() -> None:
    ws, sock, owner, session = opened()
    ws.upgrade(KEY)
    session.close(CloseReason.SHUTDOWN)
    assert after_handshake(sock) == [(wsframes.OP_CLOSE, (4000).to_bytes(2, "big") + b"shutdown")]
    assert not sock.closed
    ws.data_received(client_frame(wsframes.OP_TEXT, b"late"))  # ignored while closing
    ws.data_received(client_frame(wsframes.OP_CLOSE, (4000).to_bytes(2, "big")))
    assert sock.closed and owner.commands == []
    assert owner.forgotten == [CloseReason.SHUTDOWN]


async def test_without_the_clients_close_frame_the_socket_is_aborted() -> None:
    ws, sock, _, session = opened()
    ws.upgrade(KEY)
    session.close(CloseReason.SESSION_EXPIRED)
    await eventually(lambda: sock.aborted, "the socket aborted after the close timeout", 5)


async def test_violations_close_with_rfc_codes() -> None:
    cases = [
        (client_frame(wsframes.OP_TEXT, b"x", mask=False), 1002, CloseReason.PROTOCOL_ERROR),
        (client_frame(wsframes.OP_BINARY, b"x"), 1003, CloseReason.UNSUPPORTED_DATA),
        (client_frame(wsframes.OP_TEXT, b"\xff\xfe"), 1007, CloseReason.INVALID_DATA),
        (client_frame(wsframes.OP_TEXT, b"x" * 5000), 1009, CloseReason.MESSAGE_TOO_BIG),
        (client_frame(wsframes.OP_CONTINUATION, b"x"), 1002, CloseReason.PROTOCOL_ERROR),
    ]
    for data, code, reason in cases:
        ws, sock, owner, _ = opened()
        ws.upgrade(KEY)
        ws.data_received(data)
        assert after_handshake(sock)[-1][1][:2] == code.to_bytes(2, "big")
        assert owner.forgotten == [reason]


async def test_a_fragmented_message_over_the_cap_is_too_big() -> None:
    ws, sock, owner, _ = opened(max_message=100)
    ws.upgrade(KEY)
    for _ in range(3):
        ws.data_received(client_frame(wsframes.OP_TEXT if not _ else 0, b"y" * 40, fin=False))
    assert owner.forgotten == [CloseReason.MESSAGE_TOO_BIG]
    assert after_handshake(sock)[-1][1][:2] == (1009).to_bytes(2, "big")


async def test_a_missing_pong_closes_on_the_next_wheel_visit() -> None:
    ws, sock, owner, session = opened()
    ws.upgrade(KEY)
    session.go_live()
    now = time.monotonic() + 1  # the wheel's clock (nothing was read after this)
    session.tick(now, b": ping\n\n")
    assert after_handshake(sock) == [(wsframes.OP_PING, b"")]
    assert ws.overdue(now + 20) is CloseReason.PING_TIMEOUT
    ws.data_received(client_frame(wsframes.OP_PONG, b""))  # answered
    session.tick(now + 20, b": ping\n\n")  # one period later: fine, a new ping
    assert session.closed is None
    session.tick(now + 40, b": ping\n\n")  # that one was never answered
    assert owner.forgotten == [CloseReason.PING_TIMEOUT]
    assert after_handshake(sock)[-1] == (
        wsframes.OP_CLOSE,
        (4006).to_bytes(2, "big") + b"ping_timeout",
    )
