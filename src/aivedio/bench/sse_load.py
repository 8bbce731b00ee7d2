"""The SSE load generator shared by ``bench connections`` and ``bench fanout``.

- ``GatewayProcess``: the gateway under test (``aivedio.bench.gateway_server``) in a process of
  its own, with its RSS (``/proc/<pid>/status`` VmRSS) and CPU time (``/proc/<pid>/stat``).
- ``ClientFleet``: client processes (spawned), each holding its share of the connections as raw
  asyncio protocols: one request write, then a byte parser that splits frames on a blank line and
  records, per read, one ``time.time()`` stamp (every process on the machine shares that clock):
  ``: ping`` arrivals per connection, and the receive times of each event by seq. A process
  reports back through its pipe: first how many connections it established, then, on ``stop``,
  everything it recorded.
- ``gateway_under_test``: scratch database, a project with an API key, a unique Redis channel and
  key prefix, the gateway process; all removed afterwards, also on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import signal
import sys
import time
import uuid
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

import asyncpg
import redis.asyncio as aioredis

from aivedio.admin import create_project_in
from aivedio.bench.common import database_url, scratch_database
from aivedio.config import Settings
from aivedio.propagation.dispatcher import broadcast_channel
from aivedio.runtime import resolve_urls

FDS_PER_PROCESS = 19_000  # open files are capped at 20,000 per process; keep some headroom
TICKS = os.sysconf("SC_CLK_TCK")


def raise_open_files() -> int:
    """RLIMIT_NOFILE soft limit up to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


# -- the gateway process ---------------------------------------------------------------------


class GatewayProcess:
    """``python -m aivedio.bench.gateway_server`` with its port, pid, RSS and CPU time."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.pid = proc.pid

    @classmethod
    async def start(
        cls,
        database_url: str,
        redis_url: str,
        channel: str,
        key_prefix: str,
        heartbeat_s: float,
        loop: str = "asyncio",
        timeout_s: float = 30.0,
    ) -> GatewayProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aivedio.bench.gateway_server",
            "--database-url",
            database_url,
            "--redis-url",
            redis_url,
            "--channel",
            channel,
            "--key-prefix",
            key_prefix,
            "--heartbeat-s",
            str(heartbeat_s),
            "--loop",
            loop,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(f"the gateway process exited ({await proc.wait()})")
            ready = json.loads(line)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        return cls(proc, int(ready["port"]))

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    async def wait_idle(
        self, below_pct: float = 5.0, window_s: float = 0.5, timeout_s: float = 120.0
    ) -> float:
        """Wait until the process uses less than ``below_pct`` of a core over ``window_s`` (its
        backlog is written); returns the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            cpu = self.cpu_s()
            await asyncio.sleep(window_s)
            if (self.cpu_s() - cpu) / window_s * 100 < below_pct:
                break
        return time.monotonic() - started

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    async def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


@dataclass(frozen=True, slots=True)
class Target:
    """The gateway under test, as the bench driver sees it."""

    database_url: str
    redis_url: str
    channel: str
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    api_key: str
    gateway: GatewayProcess


@contextlib.asynccontextmanager
async def gateway_under_test(
    settings: Settings, heartbeat_s: float, loop: str = "asyncio"
) -> AsyncIterator[Target]:
    urls = resolve_urls(settings)
    tag = uuid.uuid4().hex[:10]
    channel = broadcast_channel(f"bench{tag}")
    key_prefix = f"bench{tag}:gw"
    async with scratch_database(database_url(settings)) as url:
        conn = await asyncpg.connect(url)
        try:
            made = await create_project_in(conn, "bench", "sse")
        finally:
            await conn.close()
        gateway = await GatewayProcess.start(
            url, urls.redis_url, channel, key_prefix, heartbeat_s, loop
        )
        try:
            yield Target(
                url,
                urls.redis_url,
                channel,
                uuid.UUID(made["project_id"]),
                uuid.UUID(made["tenant_id"]),
                uuid.UUID(made["user_id"]),
                made["api_key"],
                gateway,
            )
        finally:
            await gateway.stop()
            await _delete_keys(urls.redis_url, f"{key_prefix}:*")


async def _delete_keys(redis_url: str, pattern: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


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


# -- the fleet (bench driver side) -----------------------------------------------------------


def split(total: int, parts: int) -> list[int]:
    """``total`` connections over ``parts`` processes, as evenly as possible."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts) if base or i < extra]


@dataclass(slots=True)
class Ready:
    established: int = 0
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


class ClientFleet:
    """Client processes holding ``total`` connections to one project's stream."""

    def __init__(self, target: Target, total: int, procs: int, record_events: bool) -> None:
        self.specs = [
            ClientSpec(
                "127.0.0.1",
                target.gateway.port,
                str(target.project_id),
                target.api_key,
                n,
                record_events=record_events,
            )
            for n in split(total, procs)
        ]
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for spec in self.specs:
            mine, theirs = ctx.Pipe()
            self.procs.append(ctx.Process(target=client_process, args=(spec, theirs), daemon=True))
            self.pipes.append(mine)

    async def connect(self, timeout_s: float = 300.0) -> Ready:
        """Start the processes; returns once every one has opened its connections."""
        started = time.perf_counter()
        for proc in self.procs:
            proc.start()
        ready = Ready()
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            kind, established, failed, failures = await _receive(pipe, proc, timeout_s)
            assert kind == "ready"
            ready.established += established
            ready.failed += failed
            ready.failures.update(failures)
        ready.seconds = time.perf_counter() - started
        return ready

    async def stop(self, timeout_s: float = 120.0) -> Report:
        """Close every connection; the merged reports of all processes."""
        for pipe in self.pipes:
            pipe.send("stop")
        merged = Report()
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            kind, report = await _receive(pipe, proc, timeout_s)
            assert kind == "report"
            merged.established += report.established
            merged.failed += report.failed
            merged.failures.update(report.failures)
            merged.lost += report.lost
            merged.closes.update(report.closes)
            merged.resets += report.resets
            merged.pings.extend(report.pings)
            merged.cpu_s += report.cpu_s
            merged.connect_s = max(merged.connect_s, report.connect_s)
            for seq, times in report.events.items():
                merged.events.setdefault(seq, array("d")).extend(times)
        return merged

    async def close(self) -> None:
        """Reap the processes (kill what does not exit); safe to call after a failure."""
        for proc in self.procs:
            if proc.pid is None:
                continue
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        for pipe in self.pipes:
            pipe.close()


async def _receive(pipe: Connection, proc: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(pipe.poll, 0.2):
        if not proc.is_alive():
            raise RuntimeError(f"client process {proc.pid} exited ({proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"client process {proc.pid} did not answer in {timeout_s:g} s")
    return pipe.recv()


@contextlib.asynccontextmanager
async def fleet(
    target: Target, total: int, procs: int, record_events: bool
) -> AsyncIterator[ClientFleet]:
    clients = ClientFleet(target, total, procs, record_events)
    try:
        yield clients
    finally:
        for pipe in clients.pipes:
            with contextlib.suppress(OSError):
                pipe.send("stop")
        await clients.close()
