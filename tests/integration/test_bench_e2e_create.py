"""``bench e2e``'s task creation sends a request again, with its Idempotency-Key, after the
server reset the connection before answering (what a keep-alive connection closed by the
server just as the request was written to gives): a real socket reset, from a server that resets
the first connection it reads a request on and answers the requests after that."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

from aivedio.bench.e2e_deploy import create_tasks


class ResetOnce:
    """An HTTP/1.1 server on 127.0.0.1 that resets its first request's connection (SO_LINGER 0,
    then close: an RST) and answers every later request 202 with a task; records the
    Idempotency-Key of each request it read."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")[1:]
                headers = {
                    name.lower(): value
                    for name, _, value in (line.partition(": ") for line in lines if line)
                }
                await reader.readexactly(int(headers.get("content-length", "0")))
                self.keys.append(headers["idempotency-key"])
                if len(self.keys) == 1:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                body = json.dumps({"task": {"id": f"task-{len(self.keys)}"}}).encode()
                writer.write(
                    b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_a_reset_connection_is_sent_again_with_its_key() -> None:
    server = ResetOnce()
    base = await server.start()
    try:
        ids, resent = await create_tasks(base, [("p1", "key")], 1, 1)
    finally:
        await server.close()
    assert resent == 1
    assert ids == ["task-2"]
    assert server.keys == ["e2e-p1-0", "e2e-p1-0"]  # the same key both times
