"""A TCP proxy that tests can cut and restore, to take a real server away mid-run."""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._silent: set[asyncio.StreamWriter] = set()  # client sides that hear nothing more
        self._generation = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Stop listening and reset every open connection."""
        self._generation += 1
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        self._clients.clear()
        self._silent.clear()

    async def say_and_go_silent(self, data: bytes) -> int:
        """Write ``data`` to every open client connection as if the server sent it, then pass
        nothing more either way on those connections, which stay open: a server that ended
        the session but whose socket has not closed yet. New connections work as before.
        Returns how many connections heard it."""
        clients = list(self._clients - self._silent)
        for writer in clients:
            self._silent.add(writer)
            writer.write(data)
            with contextlib.suppress(ConnectionError, OSError):
                await writer.drain()
        return len(clients)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        generation = self._generation
        if self._server is None:  # accepted just before a cut, handled after it
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if generation != self._generation:  # cut while this connection was being made
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers.update({writer, up_writer})
        self._clients.add(writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    if writer in self._silent:
                        continue
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._clients.discard(writer)
        self._silent.discard(writer)
        for w in (writer, up_writer):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.close()
