"""The browsers of a chaos run: they read every frame and resume by cursor like the real client.

- :class:`StreamWatcher`: :class:`aivedio.client.Client` over SSE or WebSocket, reconnecting by
  cursor whenever the server goes away; ``hop_s`` makes it also drop its own connection every
  few seconds and resume (a tab that navigates, a phone that changes networks).
- :class:`SlowReader`: a raw SSE socket with a tiny receive buffer that stops reading for longer
  than the gateway's stall timeout, so the gateway evicts it; it then reads what had arrived and
  resumes from the last complete frame with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from typing import Any
from urllib.parse import urlsplit

from aivedio.chaos.invariants import ClientLog
from aivedio.client import Client, StreamRefused

__all__ = ["SlowReader", "StreamWatcher"]


class StreamWatcher:
    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str,
        project_id: str,
        *,
        transport: str = "sse",
        hop_s: tuple[float, float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.client = Client(
            base_url,
            api_key,
            project_id,
            transport=transport,
            origin=base_url if transport == "ws" else None,
            backoff_max_s=2.0,
        )
        self.log = ClientLog(name, project_id, transport, start_seq=0)
        self.hop_s = hop_s
        self.rng = rng or random.Random()
        self.refused: StreamRefused | None = None

    async def start(self) -> None:
        """Read the snapshot (retrying while the API is away): the stream starts from it."""
        while True:
            try:
                await self.client.snapshot()
                break
            except Exception:  # the API may be down at this moment: try again
                await asyncio.sleep(0.5)
        self.log.start_seq = self.client.view.last_seq

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                if self.hop_s is None:
                    await self._read(stopping)
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.rng.uniform(*self.hop_s)):
                            await self._read(stopping)
            except StreamRefused as exc:  # a credential problem: reconnecting cannot help
                self.refused = exc
                return

    async def _read(self, stopping: asyncio.Event) -> None:
        async for _ in self.client.events():
            if stopping.is_set():
                return

    @property
    def last_seq(self) -> int:
        return self.client.view.last_seq

    def finish(self) -> ClientLog:
        self.log.connects = self.client.connects
        self.log.frames = [(f.event, f.seq, f.data) for f in self.client.frames]
        return self.log

    async def aclose(self) -> None:
        await self.client.aclose()


class SlowReader:
    """A client too slow for the gateway: evicted, then resumed exactly by ``Last-Event-ID``."""

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str,
        project_id: str,
        *,
        cursor: str,
        start_seq: int,
        stall_s: float,
    ) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.api_key = api_key
        self.project_id = project_id
        self.cursor = cursor
        self.stall_s = stall_s
        self.log = ClientLog(name, project_id, "sse-slow", start_seq=start_seq)
        self.last_seq = start_seq

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(OSError):
                await self._one_connection(stopping)
            await asyncio.sleep(0.2)

    async def _one_connection(self, stopping: asyncio.Event) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, (self.host, self.port))
        except OSError:
            sock.close()
            raise
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        try:
            head = (
                f"GET /v1/projects/{self.project_id}/events HTTP/1.1\r\n"
                f"Host: {self.host}:{self.port}\r\nAccept: text/event-stream\r\n"
                f"Authorization: Bearer {self.api_key}\r\nLast-Event-ID: {self.cursor}\r\n\r\n"
            )
            writer.write(head.encode())
            await writer.drain()
            self.log.connects += 1
            # Not reading: the server's buffers fill and it evicts us after its stall timeout.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.stall_s)
            await self._read(reader, stopping)
        finally:
            writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, stopping: asyncio.Event) -> None:
        status = await reader.readline()
        if not status.startswith(b"HTTP/1.1 200"):
            return
        while (await reader.readline()).strip():
            pass  # the response head
        frame: dict[str, str] = {}
        data: list[str] = []
        while not stopping.is_set():
            try:
                raw = await asyncio.wait_for(reader.readline(), 5.0)
            except TimeoutError:
                return  # caught up and nothing new: reconnect (slow again) from the cursor
            if not raw:
                self.log.evictions += 1  # the server closed the stream: evicted, or restarted
                return
            line = raw.decode().rstrip("\r\n")
            if line == "":
                if data:
                    self._frame(frame, "\n".join(data))
                frame, data = {}, []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                frame[name] = value

    def _frame(self, frame: dict[str, str], data: str) -> None:
        event = frame.get("event", "message")
        frame_id = frame.get("id")
        payload: dict[str, Any] = json.loads(data)
        seq = int(frame_id.rpartition("-")[2]) if frame_id else None
        self.log.frames.append((event, seq, payload))
        if frame_id:
            self.cursor = frame_id
            if seq is not None:
                self.last_seq = max(self.last_seq, seq)

    def finish(self) -> ClientLog:
        return self.log

    async def aclose(self) -> None:
        return None
