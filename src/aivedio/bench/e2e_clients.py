"""``bench e2e``: SSE clients in a process of their own, reading and stamping every frame.

Raw asyncio protocols on uvloop (the instrument must cost less than what it measures): one
``GET /v1/projects/{id}/events`` per connection, a byte parser that splits frames on the blank
line, and per ``task.status`` frame its task, progress and version (the ``data:`` JSON), the read
time, and the gateway's diagnostic ``: timing`` line when the deployment has it on
(``AIVEDIO_GATEWAY_TIMING``). The parent tells the process which (task, progress) pairs a step
sent (``expect``), asks how many of them arrived (``status``), and collects the frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import orjson

NAN = math.nan


@dataclass(frozen=True, slots=True)
class Stream:
    """One SSE connection to open: the project and the ``Authorization`` header (if any)."""

    project_id: str
    authorization: str | None


@dataclass(slots=True)
class Frames:
    """The ``task.status`` frames read since the last collect, one entry per frame."""

    task_id: list[str] = field(default_factory=list)
    progress: list[int] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    read: list[float] = field(default_factory=list)
    relayed: list[float] = field(default_factory=list)
    dispatched: list[float] = field(default_factory=list)
    written: list[float] = field(default_factory=list)
    other: int = 0  # frames that were not task.status (resets)

    def __len__(self) -> int:
        return len(self.read)


class _Reader:
    """Every connection's frames, and the arrivals of what the current step sent."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.expected: set[tuple[str, int]] = set()
        self.arrived = 0
        self.last_at = 0.0

    def frame(self, data: bytes, comment: bytes | None, now: float) -> None:
        body = orjson.loads(data)
        task_id, progress = str(body.get("task_id")), body.get("progress")
        progress = progress if isinstance(progress, int) else -1
        f = self.frames
        f.task_id.append(task_id)
        f.progress.append(progress)
        version = body.get("task_version")
        f.version.append(version if isinstance(version, int) else -1)
        f.read.append(now)
        relayed = dispatched = written = NAN
        if comment is not None:
            parts = comment.split()
            if len(parts) == 4 and parts[0] == b"timing":
                relayed, dispatched, written = (_number(p) for p in parts[1:])
        f.relayed.append(relayed)
        f.dispatched.append(dispatched)
        f.written.append(written)
        key = (task_id, progress)
        if key in self.expected:
            self.expected.discard(key)
            self.arrived += 1
        self.last_at = now


def _number(text: bytes) -> float:
    try:
        return float(text)
    except ValueError:
        return NAN


class _Client(asyncio.Protocol):
    def __init__(self, request: bytes, reader: _Reader, ready: asyncio.Future[None]) -> None:
        self.request = request
        self.reader = reader
        self.ready = ready
        self.buf = b""
        self.head_done = False
        self.chunked: bytes | None = None  # undecoded chunked transfer-coding (uvicorn's)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("closed before the stream started"))

    def data_received(self, data: bytes) -> None:
        now = time.time()
        if not self.head_done:
            head = self.buf + data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                self.buf = head
                return
            if not head.startswith(b"HTTP/1.1 200"):
                if not self.ready.done():
                    self.ready.set_exception(ConnectionError(head[:12].decode("latin-1")))
                return
            self.head_done = True
            self.buf = b""
            if b"transfer-encoding: chunked" in head[:end].lower():
                self.chunked = b""
            data = head[end + 4 :]
        if self.chunked is not None:
            data = self._dechunk(data)
        buf = self.buf + data if self.buf else data
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._frame(buf[start:end], now)
            start = end + 2
        self.buf = buf[start:]

    def _dechunk(self, data: bytes) -> bytes:
        assert self.chunked is not None
        raw = self.chunked + data
        out = []
        pos = 0
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            if len(raw) < eol + 2 + size + 2:
                break
            out.append(raw[eol + 2 : eol + 2 + size])
            pos = eol + 2 + size + 2
        self.chunked = raw[pos:]
        return b"".join(out)

    def _frame(self, frame: bytes, now: float) -> None:
        if frame.startswith(b"id: "):
            data = comment = None
            kind = b""
            for line in frame.split(b"\n"):
                if line.startswith(b"data: "):
                    data = line[6:]
                elif line.startswith(b"event: "):
                    kind = line[7:]
                elif line.startswith(b": "):
                    comment = line[2:]
            if kind == b"task.status" and data is not None:
                self.reader.frame(data, comment, now)
            else:
                self.reader.frames.other += 1
        elif frame.startswith(b": start") and not self.ready.done():
            self.ready.set_result(None)


async def _serve(pipe: Connection) -> None:
    loop = asyncio.get_running_loop()
    kind, init = pipe.recv()
    assert kind == "init"
    reader = _Reader()
    clients: list[_Client] = []
    failures: list[str] = []
    host, port = init["host"], init["port"]
    for stream in init["streams"]:
        auth = f"Authorization: {stream.authorization}\r\n" if stream.authorization else ""
        request = (
            f"GET /v1/projects/{stream.project_id}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"{auth}Accept: text/event-stream\r\n\r\n"
        ).encode()
        ready: asyncio.Future[None] = loop.create_future()
        client = _Client(request, reader, ready)
        try:
            async with asyncio.timeout(30):
                await loop.create_connection(lambda c=client: c, host, port)  # type: ignore[misc]
                await ready
            clients.append(client)
        except (OSError, TimeoutError) as exc:
            failures.append(repr(exc))
    pipe.send(("ready", len(clients), failures))
    while True:
        kind, body = await loop.run_in_executor(None, pipe.recv)
        if kind == "stop":
            break
        if kind == "expect":
            reader.expected = set(body)
            reader.arrived = 0
            pipe.send(("ok", None))
        elif kind == "status":
            alive = sum(c.transport is not None for c in clients)
            pipe.send(("status", (reader.arrived, len(reader.frames), reader.last_at, alive)))
        elif kind == "collect":
            frames, reader.frames = reader.frames, Frames()
            pipe.send(("frames", frames))
    for client in clients:
        if client.transport is not None:
            client.transport.abort()


def clients_main(pipe: Connection) -> None:
    import uvloop

    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        runner.run(_serve(pipe))


@dataclass(frozen=True, slots=True)
class Arrivals:
    arrived: int
    frames: int
    last_at: float
    alive: int


class ClientsProcess:
    """The parent's handle on the SSE clients."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=clients_main, args=(theirs,), daemon=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    async def start(self, host: str, port: int, streams: Sequence[Stream]) -> int:
        """Open every stream; returns once each one is live (``: start`` read)."""
        self.proc.start()
        self.pipe.send(("init", {"host": host, "port": port, "streams": list(streams)}))
        kind, opened, failures = await self._receive(120)
        assert kind == "ready"
        if failures:
            raise RuntimeError(f"{len(failures)} SSE streams did not open: {failures[:3]}")
        return int(opened)

    async def expect(self, keys: Sequence[tuple[str, int]]) -> None:
        self.pipe.send(("expect", list(keys)))
        await self._receive(60)

    async def status(self) -> Arrivals:
        self.pipe.send(("status", None))
        _, (arrived, frames, last_at, alive) = await self._receive(60)
        return Arrivals(arrived, frames, last_at, alive)

    async def collect(self) -> Frames:
        self.pipe.send(("collect", None))
        _, frames = await self._receive(120)
        return cast(Frames, frames)

    async def _receive(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.pipe.poll, 0.05):
            if not self.proc.is_alive():
                raise RuntimeError(f"the SSE client process exited ({self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError("the SSE client process did not answer")
        return self.pipe.recv()

    async def stop(self) -> None:
        if self.proc.pid is None:
            return
        with contextlib.suppress(OSError):
            self.pipe.send(("stop", None))
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        self.pipe.close()
