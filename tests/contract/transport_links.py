"""The links of the transport contract: SSE and WebSocket over real sockets, and the fake.

The real transports are served by the real HTTP front door (``serve_http``: uvicorn and the
sniffer of ``process/http_server.py``, which picks the transport by path and hands the socket over).
In place of the gateway stands an :class:`Acceptor`: it answers a stream request as the gateway
does once the client is admitted (``begin``, or ``upgrade`` with the request's key) and gives the
transport to the test. The peers are real clients: an SSE reader on a plain socket, and the
``websockets`` client (which answers pings and close frames itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import uuid
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from aivedio.gateway import GatewayConfig
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.frames import RESPONSE_HEAD
from aivedio.gateway.protocol import parse_head
from aivedio.gateway.transport import SseTransport
from aivedio.gateway.websocket import WsTransport
from aivedio.process.http_server import serve_http
from tests.contract.transport_contract import Link, Seen, SessionRecorder, parse_sse
from tests.fakes.transport import RecordingTransport
from tests.waiting import eventually

# Small buffers, so that a peer that stops reading fills them after a few hundred frames.
CONFIG = GatewayConfig(
    redis_url="redis://unused",
    write_high_water=32 * 1024,
    write_low_water=8 * 1024,
    socket_send_buffer=16 * 1024,
    ws_close_timeout_s=5.0,
)


class Acceptor:
    """What ``serve_http`` and the sniffer need of a ``Gateway``, and no more."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.accepted: asyncio.Queue[tuple[SseTransport | WsTransport, SessionRecorder]] = (
            asyncio.Queue()
        )
        self.streams: list[SseTransport | WsTransport] = []  # every one, closed at the end

    async def start(self) -> None:
        pass

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def accept(self, transport: SseTransport | WsTransport, head: bytes) -> None:
        request = parse_head(head)
        events = SessionRecorder()
        transport.session = events  # type: ignore[assignment]
        if isinstance(transport, WsTransport):
            assert request.ws_key is not None
            transport.upgrade(request.ws_key)
        else:
            transport.begin(self.config.retry_ms)
        self.streams.append(transport)
        self.accepted.put_nowait((transport, events))


async def no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("no request reaches the ASGI app in these tests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def front_door() -> AsyncIterator[tuple[int, Acceptor]]:
    """The real HTTP front door on a free port, its streams handed to an ``Acceptor``."""
    acceptor = Acceptor(CONFIG)
    port = free_port()
    stopping = asyncio.Event()
    server = asyncio.create_task(
        serve_http(no_app, "127.0.0.1", port, acceptor, stopping, callbacks=None)  # type: ignore[arg-type]
    )

    async def accepts() -> bool:
        if server.done():
            server.result()  # its error, if it failed to start
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True

    await eventually(accepts, "the server accepts connections")
    try:
        yield port, acceptor
    finally:
        for stream in acceptor.streams:  # whatever the test left open (a failed one)
            stream.transport.abort()
        stopping.set()
        await server


def reset(transport: asyncio.BaseTransport) -> None:
    """Close with a TCP reset (RST), not a FIN: linger on, zero seconds."""
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def accepted(acceptor: Acceptor) -> tuple[Any, SessionRecorder]:
    async def one() -> tuple[Any, SessionRecorder] | None:
        return None if acceptor.accepted.empty() else acceptor.accepted.get_nowait()

    found: tuple[Any, SessionRecorder] = await eventually(one, "the stream request accepted")
    return found


class SseLink(Link):
    """An SSE client on a plain socket; a reader task collects the bytes (paused on demand)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.data = b""
        self.reading = asyncio.Event()
        self.reading.set()
        self.ended = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, port: int, acceptor: Acceptor) -> SseLink:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        path = f"/v1/projects/{uuid.uuid4()}/events"
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        link = cls(reader, writer)
        link.transport, link.events = await accepted(acceptor)
        assert isinstance(link.transport, SseTransport)
        return link

    async def _read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                chunk = await self.reader.read(65536)
                if not chunk:
                    break
                self.data += chunk
        except OSError:
            pass  # reset: the stream ended
        finally:
            self.ended.set()

    def _body(self) -> bytes:
        head, _, body = self.data.partition(b"\r\n\r\n")
        if head:
            assert head + b"\r\n\r\n" == RESPONSE_HEAD
        return body

    def seen(self) -> list[Seen]:
        return parse_sse(self._body())[0]

    async def goodbye(self) -> CloseReason | None:
        await eventually(self.ended.is_set, "the end of the stream")
        _, closes, after_close = parse_sse(self._body())
        assert not after_close, "a frame arrived after the goodbye"
        assert len(closes) <= 1
        if not closes:
            return None
        code, label = closes[0]
        reason = next(r for r in CloseReason if r.code == code)
        assert reason.label == label
        return reason

    def stop_reading(self) -> None:
        self.reading.clear()

    def resume_reading(self) -> None:
        self.reading.set()

    async def hang_up(self, abrupt: bool) -> None:
        if abrupt:
            reset(self.writer.transport)
        else:
            self.writer.close()

    async def aclose(self) -> None:
        self.writer.transport.abort()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class WsLink(Link):
    """The ``websockets`` client; a reader task collects the messages (paused on demand: with a
    small ``max_queue`` the client then stops reading its socket)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.messages: list[dict[str, Any]] = []
        self.reading = asyncio.Event()
        self.reading.set()
        self.ended = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, port: int, acceptor: Acceptor) -> WsLink:
        url = f"ws://127.0.0.1:{port}/v1/projects/{uuid.uuid4()}/ws"
        ws = await connect(url, compression=None, proxy=None, ping_interval=None, max_queue=4)
        link = cls(ws)
        link.transport, link.events = await accepted(acceptor)
        assert isinstance(link.transport, WsTransport)
        return link

    async def _read(self) -> None:
        try:
            while True:
                await self.reading.wait()
                self.messages.append(json.loads(await self.ws.recv()))
        except ConnectionClosed:
            pass
        finally:
            self.ended.set()

    def seen(self) -> list[Seen]:
        return [
            Seen(m["event_id"], m["task_id"], m["payload"]["status"], m["payload"]["error"])
            for m in self.messages
            if m["type"] == "task.status"
        ]

    async def goodbye(self) -> CloseReason | None:
        await eventually(self.ended.is_set, "the end of the connection")
        rcvd = self.ws.protocol.close_rcvd
        if rcvd is None:
            return None
        reason = next(r for r in CloseReason if r.ws_code == rcvd.code)
        assert reason.label == rcvd.reason
        return reason

    def stop_reading(self) -> None:
        self.reading.clear()

    def resume_reading(self) -> None:
        self.reading.set()

    async def hang_up(self, abrupt: bool) -> None:
        if abrupt:
            reset(self.ws.transport)
        else:
            await self.ws.close()

    async def aclose(self) -> None:
        self.ws.transport.abort()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class FakeLink(Link):
    """The fake reads its own record: its frames are SSE-encoded (``frame_of`` is the event's
    frame); its socket events are its methods."""

    def __init__(self) -> None:
        self.fake = RecordingTransport()
        self.transport = self.fake
        self.events = SessionRecorder()
        self.fake.session = self.events

    def seen(self) -> list[Seen]:
        return parse_sse(b"".join(self.fake.frames))[0]

    async def goodbye(self) -> CloseReason | None:
        reason = self.fake.closed
        assert reason is not None, "never closed"
        return None if reason.abrupt else reason  # what a peer is told of it

    def stop_reading(self) -> None:
        self.fake.stall()

    def resume_reading(self) -> None:
        self.fake.drain()

    async def hang_up(self, abrupt: bool) -> None:
        self.fake.hang_up()
