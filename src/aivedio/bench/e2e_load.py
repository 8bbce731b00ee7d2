"""``bench e2e``: the load generator, a process of its own sending signed webhooks open loop.

It speaks the sandbox provider's webhook protocol exactly (``aivedio.sandbox.webhooks``: the
``generation.updated`` body of a generation view, ``webhook-id: msg_<generation>_<sequence>``,
Standard Webhooks signatures with the sandbox's ``whsec_`` secrets) to the real callback endpoint,
over keep-alive HTTP/1.1 connections with one request in flight each, like the sandbox's pool of
delivery workers. Every step's requests are built and signed before the step starts, so the
measured window only writes bytes and reads answers.

Open loop: webhook ``i`` of a step is due ``i / rate`` seconds after the step's start, whatever the
answers do; latency counts from that due time (no coordinated omission). When every connection is
busy the webhook waits for one (the sender's lag is reported, never hidden).

The parent talks to the process over a pipe (``LoadProcess``): ``init`` (port, secrets, the task
table), ``arm`` (a step: build its requests, open connections), ``go`` (the start time), then one
``LoadResult`` per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import random
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from aivedio.bench.e2e_schedule import Step
from aivedio.sandbox.config import decode_webhook_secret
from aivedio.sandbox.simulation import iso
from aivedio.sandbox.webhooks import event_body, sign


@dataclass(frozen=True, slots=True)
class Generation:
    """What the provider knows of one task: its generation id and the metadata it echoes."""

    id: str
    metadata: dict[str, str]


@dataclass(slots=True)
class LoadResult:
    """Per webhook of the step (index ``i``): when it was due, written and answered (Unix
    seconds; ``nan`` if never), and the answer's status (0: none)."""

    due: array[float]
    written: array[float]
    answered: array[float]
    status: array[int]
    cpu_s: float
    build_s: float
    retried: int = 0  # sends again after a non-2xx answer or a closed connection

    def lag_ms(self) -> list[float]:
        return [
            (w - d) * 1000 for w, d in zip(self.written, self.due, strict=True) if not math.isnan(w)
        ]


def build_requests(
    step: Step,
    table: Sequence[Generation],
    keys: Sequence[bytes],
    points: int,
    host: str,
    provider: str = "sandbox",
) -> list[bytes]:
    """The signed HTTP requests of a step, as the sandbox would send each change."""
    now = time.time()
    stamp, updated = int(now), iso(now)
    path = f"/v1/callbacks/{provider}"
    out = []
    for task, nth in zip(step.tasks, step.nth, strict=True):
        generation = table[task]
        sequence = nth + 1  # the creation (queued) was sequence 1
        body = event_body(
            {
                "id": generation.id,
                "status": "running",
                "progress": nth * points,
                "sequence": sequence,
                "updated_at": updated,
                "error": None,
                "output": None,
                "metadata": generation.metadata,
            }
        )
        msg_id = f"msg_{generation.id}_{sequence}"
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nwebhook-id: {msg_id}\r\n"
            f"webhook-timestamp: {stamp}\r\nwebhook-signature: {sign(keys, msg_id, stamp, body)}"
            "\r\n\r\n"
        )
        out.append(head.encode("ascii") + body)
    return out


class _Connection(asyncio.Protocol):
    def __init__(self, sender: _Sender) -> None:
        self.sender = sender
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.current = -1  # the webhook in flight

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.sender.lost(self)

    def send(self, i: int, request: bytes) -> None:
        assert self.transport is not None
        self.current = i
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            length = 0
            at = buf.find(b"content-length:", 0, end)
            if at < 0:
                at = buf.find(b"Content-Length:", 0, end)
            if at >= 0:
                length = int(buf[at + 15 : buf.find(b"\r\n", at)])
            if len(buf) < end + 4 + length:
                break
            status = int(buf[9:12])
            buf = buf[end + 4 + length :]
            self.sender.answered(self, status)
        self.buf = buf


MAX_ATTEMPTS = 5  # the sandbox's webhook_max_attempts (first try included)
BACKOFF_S = 0.5  # the sandbox's webhook_backoff_s: retry n waits 0.5 * 2^(n-1) * U(0.8, 1.2)


class _Sender:
    """Sends a step's webhooks over a fixed pool of connections; a webhook answered non-2xx, or
    whose connection closed before its answer (a keep-alive connection the server closed just
    as it was written to), is sent again with the sandbox's backoff, as the sandbox would."""

    def __init__(self, port: int, target: int) -> None:
        self.port = port
        self.target = target  # connections, as a provider's fixed pool of delivery workers
        self.conns: list[_Connection] = []
        self.idle: list[_Connection] = []
        self.freed = asyncio.Event()
        self.result: LoadResult | None = None
        self.outstanding = 0
        self.again: deque[int] = deque()  # webhooks whose retry is due
        self.attempts = array("i")

    async def ensure(self, connections: int) -> None:
        loop = asyncio.get_running_loop()
        self.conns = [c for c in self.conns if c.transport is not None]
        self.idle = [c for c in self.conns if c.current < 0]
        while len(self.conns) < connections:
            _, conn = await loop.create_connection(
                lambda: _Connection(self), "127.0.0.1", self.port
            )
            self.conns.append(conn)
            self.idle.append(conn)

    def _settle(self, i: int, status: int) -> None:
        result = self.result
        if result is None:
            return
        if 200 <= status < 300 or self.attempts[i] >= MAX_ATTEMPTS:
            result.answered[i] = time.time()
            result.status[i] = status
            self.outstanding -= 1
            return
        result.retried += 1
        delay = BACKOFF_S * 2 ** (self.attempts[i] - 1) * random.uniform(0.8, 1.2)
        asyncio.get_running_loop().call_later(delay, self._due_again, i)

    def _due_again(self, i: int) -> None:
        self.again.append(i)
        self.freed.set()

    def answered(self, conn: _Connection, status: int) -> None:
        if conn.current >= 0:
            self._settle(conn.current, status)
        conn.current = -1
        self.idle.append(conn)
        self.freed.set()

    def lost(self, conn: _Connection) -> None:
        if conn.current >= 0:
            self._settle(conn.current, 0)  # no answer
        conn.current = -1
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        self.freed.set()

    async def run(self, requests: list[bytes], rate: float, start: float, timeout_s: float) -> None:
        """Send ``requests[i]`` at ``start + i / rate`` (Unix time), retries as they come due,
        then wait for the last answers (at most ``timeout_s``)."""
        result = self.result
        assert result is not None
        n = len(requests)
        self.attempts = array("i", [0]) * n
        offset = time.time() - time.perf_counter()
        begin = start - offset  # on the perf_counter clock
        deadline = math.inf
        i = 0
        while i < n or self.outstanding > 0:
            now = time.perf_counter()
            if i >= n and deadline == math.inf:
                deadline = now + timeout_s
            if now > deadline:
                break
            due = min(n, math.floor((now - begin) * rate) + 1) if now >= begin else 0
            while self.idle and (self.again or i < due):
                conn = self.idle.pop()
                if conn.transport is None:
                    continue
                if self.again:
                    j = self.again.popleft()
                else:
                    j, i = i, i + 1
                    result.written[j] = time.time()
                    self.outstanding += 1
                self.attempts[j] += 1
                conn.send(j, requests[j])
            if i < due or self.again or i >= n:  # wait for a connection, a retry, the answers
                self.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), 0.05 if i < n else 0.2)
                if not self.idle and len(self.conns) > sum(
                    c.transport is not None for c in self.conns
                ):
                    await self.ensure(self.target)  # the server closed some: reopen them
                continue
            await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))


async def _serve(pipe: Connection) -> None:
    loop = asyncio.get_running_loop()
    kind, init = pipe.recv()
    assert kind == "init"
    table = [Generation(g, m) for g, m in init["table"]]
    keys = [decode_webhook_secret(s) for s in init["secrets"]]
    host = f"127.0.0.1:{init['port']}"
    sender = _Sender(init["port"], init["connections"])
    await sender.ensure(sender.target)
    pipe.send(("ready", len(sender.conns)))
    while True:
        kind, body = await loop.run_in_executor(None, pipe.recv)
        if kind == "stop":
            break
        step: Step = body["step"]
        started = time.perf_counter()
        requests = build_requests(step, table, keys, body["points"], host)
        build_s = time.perf_counter() - started
        await sender.ensure(sender.target)  # idle ones the server closed meanwhile
        pipe.send(("armed", build_s))
        kind, start = await loop.run_in_executor(None, pipe.recv)
        assert kind == "go"
        n = len(requests)
        nan = array("d", [math.nan]) * n
        sender.result = LoadResult(
            due=array("d", (start + i / step.rate for i in range(n))),
            written=array("d", nan),
            answered=array("d", nan),
            status=array("i", [0]) * n,
            cpu_s=0.0,
            build_s=build_s,
        )
        cpu = time.process_time()
        await sender.run(requests, step.rate, start, body["timeout_s"])
        result, sender.result = sender.result, None
        result.cpu_s = time.process_time() - cpu
        pipe.send(("done", result))
    for conn in sender.conns:
        if conn.transport is not None:
            conn.transport.close()


def load_main(pipe: Connection) -> None:
    """Entry of the load-generator process (uvloop, like the deployment it loads)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(pipe))


class LoadProcess:
    """The parent's handle on the load generator."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=load_main, args=(theirs,), daemon=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    async def start(
        self, port: int, secrets: Sequence[str], table: Sequence[Generation], connections: int
    ) -> int:
        self.proc.start()
        rows = [(g.id, g.metadata) for g in table]
        self.pipe.send(("init", {"port": port, "secrets": list(secrets), "table": rows,
                                 "connections": connections}))  # fmt: skip
        kind, opened = await self._receive(60)
        assert kind == "ready"
        return int(opened)

    async def arm(self, step: Step, points: int, timeout_s: float) -> float:
        """Hand the step over; returns once its requests are built and signed."""
        self.pipe.send(("step", {"step": step, "points": points, "timeout_s": timeout_s}))
        kind, build_s = await self._receive(600)
        assert kind == "armed"
        return float(build_s)

    async def go(self, start: float, wait_s: float) -> LoadResult:
        self.pipe.send(("go", start))
        kind, result = await self._receive(wait_s)
        assert kind == "done"
        return cast(LoadResult, result)

    async def _receive(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.pipe.poll, 0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the load generator exited ({self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError("the load generator did not answer")
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
