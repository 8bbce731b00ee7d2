"""One SSE client process of the load: raw asyncio protocols holding its share of the
connections, recording ``: ping`` arrivals and each event's receive times, reported through
its pipe."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

from aivedio.bench.sse_load_gateway import raise_open_files

# -- one client connection -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientSpec:
    host: str
    port: int
    project_id: str
    api_key: str
    connections: int
    concurrency: int = 64  # connects in flight per process
    connect_timeout_s: float = 60.0
    record_events: bool = False


class Recorder:
    """What one client process saw, over all its connections."""

    def __init__(self, record_events: bool) -> None:
        self.record_events = record_events
        self.events: dict[int, array[float]] = {}
        self.resets = 0
        self.closes: Counter[str] = Counter()

    def event(self, seq: int, at: float) -> None:
        if self.record_events:
            times = self.events.get(seq)
            if times is None:
                times = self.events[seq] = array("d")
            times.append(at)


class SseClient(asyncio.Protocol):
    """One SSE connection: writes the request, parses frames, records arrival times."""

    __slots__ = (
        "buf",
        "failure",
        "head_done",
        "pings",
        "ready",
        "recorder",
        "request",
        "transport",
    )

    def __init__(self, request: bytes, recorder: Recorder, ready: asyncio.Future[None]) -> None:
        self.request = request
        self.recorder = recorder
        self.ready = ready  # resolved by the `: start` comment: the stream is live
        self.buf = b""
        self.head_done = False
        self.pings = array("d")
        self.transport: asyncio.Transport | None = None
        self.failure: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("closed before the stream started"))

    def data_received(self, data: bytes) -> None:
        now = time.time()
        buf = self.buf + data if self.buf else data
        start = 0
        if not self.head_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            if not buf.startswith(b"HTTP/1.1 200"):
                status = buf[9:12].decode("latin-1", "replace")
                if not self.ready.done():
                    self.ready.set_exception(ConnectionError(f"HTTP {status}"))
                assert self.transport is not None
                self.transport.close()
                return
            self.head_done = True
            start = end + 4
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._frame(buf, start, end, now)
            start = end + 2
        self.buf = buf[start:]

    def _frame(self, buf: bytes, start: int, end: int, now: float) -> None:
        if buf.startswith(b"id: ", start):
            line_end = buf.find(b"\n", start, end)
            if buf.startswith(b"event: reset", line_end + 1):
                self.recorder.resets += 1
                return
            dash = buf.find(b"-", start, line_end)
            self.recorder.event(int(buf[dash + 1 : line_end]), now)
        elif buf.startswith(b": ping", start):
            self.pings.append(now)
        elif buf.startswith(b": start", start):
            if not self.ready.done():
                self.ready.set_result(None)
        elif buf.startswith(b"event: close", start):
            reason = json.loads(buf[buf.find(b"data: ", start, end) + 6 : end])["reason"]
            self.recorder.closes[str(reason)] += 1


# -- one client process ----------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    """What a client process sends back when it stops."""

    established: int = 0
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    lost: int = 0  # established connections the server closed before stop
    closes: Counter[str] = field(default_factory=Counter)
    resets: int = 0
    pings: list[array[float]] = field(default_factory=list)  # per established connection
    events: dict[int, array[float]] = field(default_factory=dict)  # seq -> receive times
    cpu_s: float = 0.0
    connect_s: float = 0.0


def client_process(spec: ClientSpec, pipe: Connection) -> None:
    """A client process: uvloop (a declared dependency) keeps the clients' cost per frame low,
    so that on a small machine the clients take as little CPU from the gateway as possible."""
    import uvloop

    raise_open_files()
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        runner.run(_client_main(spec, pipe))


async def _client_main(spec: ClientSpec, pipe: Connection) -> None:
    loop = asyncio.get_running_loop()
    recorder = Recorder(spec.record_events)
    request = (
        f"GET /v1/projects/{spec.project_id}/events HTTP/1.1\r\n"
        f"Host: {spec.host}:{spec.port}\r\n"
        f"Authorization: Bearer {spec.api_key}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()
    clients: list[SseClient] = []
    report = Report()
    sem = asyncio.Semaphore(spec.concurrency)

    async def open_one() -> None:
        async with sem:
            ready: asyncio.Future[None] = loop.create_future()
            client = SseClient(request, recorder, ready)
            try:
                async with asyncio.timeout(spec.connect_timeout_s):
                    await loop.create_connection(lambda: client, spec.host, spec.port)
                    await ready
            except (OSError, TimeoutError) as exc:
                report.failed += 1
                report.failures[str(exc) if isinstance(exc, ConnectionError) else repr(exc)] += 1
                if client.transport is not None:
                    client.transport.abort()
                return
            clients.append(client)

    started = time.perf_counter()
    await asyncio.gather(*(open_one() for _ in range(spec.connections)))
    report.connect_s = time.perf_counter() - started
    report.established = len(clients)
    pipe.send(("ready", report.established, report.failed, dict(report.failures)))

    command: asyncio.Future[Any] = loop.create_future()

    def readable() -> None:
        if not command.done():
            command.set_result(pipe.recv())

    loop.add_reader(pipe.fileno(), readable)
    try:
        await command
    finally:
        loop.remove_reader(pipe.fileno())
        os.set_blocking(pipe.fileno(), True)  # uvloop made it non-blocking; the report is large
    report.lost = sum(1 for c in clients if c.transport is None)
    for client in clients:
        if client.transport is not None:
            client.transport.abort()
    await asyncio.sleep(0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report.cpu_s = usage.ru_utime + usage.ru_stime
    report.pings = [c.pings for c in clients]
    report.events = recorder.events
    report.closes = recorder.closes
    report.resets = recorder.resets
    pipe.send(("report", report))
