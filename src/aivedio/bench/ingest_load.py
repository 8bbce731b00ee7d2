"""The load generator of ``aivedio bench ingest``: signed callbacks from a template on raw
keep-alive sockets, closed- or open-loop, in processes of its own (``client_main``)."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import math
import sys
import time
from array import array
from collections import deque
from typing import Any, cast

from aivedio.bench.ingest_options import PROVIDER, SECRET

# --- the load generator (runs in its own processes) ---------------------------------------------

_BODY = (
    b'{"type":"generation.updated","data":{"id":"gen_%s_%d","status":"running","progress":42,'
    b'"sequence":3,"updated_at":"2025-01-01T00:00:00Z","error":null,"output":null,'
    b'"metadata":{"client_request_id":"cr_%d"}}}'
)
_HEAD = (
    b"POST /v1/callbacks/%s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nwebhook-id: %s\r\nwebhook-timestamp: %s\r\n"
    b"webhook-signature: v1,%s\r\n\r\n"
)


def _request(key: bytes, seq: int, run_id: str, ts: bytes | None = None) -> bytes:
    """One validly signed callback (a distinct ``webhook-id`` per ``seq``), from a template: the
    JSON is what ``json.dumps(..., separators=(",", ":"))`` writes for it."""
    rid = run_id.encode("ascii")
    msg_id = b"msg_%s_%d" % (rid, seq)
    ts = ts or str(int(time.time())).encode("ascii")
    body = _BODY % (rid, seq, seq)
    mac = hmac.digest(key, b"%s.%s.%s" % (msg_id, ts, body), "sha256")
    head = _HEAD % (
        PROVIDER.encode("ascii"),
        len(body),
        msg_id,
        ts,
        base64.b64encode(mac),
    )
    return head + body


class _Requests:
    """Signed requests in sequence; the timestamp is taken once a second (tolerance: 5 min)."""

    def __init__(self, run_id: str) -> None:
        self.key = base64.b64decode(SECRET.removeprefix("whsec_"))
        self.run_id = run_id
        self.seq = 0
        self.second = 0
        self.ts = b""

    def next(self) -> bytes:
        self.seq += 1
        now = int(time.time())
        if now != self.second:
            self.second, self.ts = now, str(now).encode("ascii")
        return _request(self.key, self.seq, self.run_id, self.ts)


class _Connection(asyncio.Protocol):
    """One keep-alive connection with one request in flight; answers go to ``_Load.answered``."""

    def __init__(self, load: _Load) -> None:
        self.load = load
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.sent_for = 0.0  # the time the request in flight counts from
        self.measured = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.load.lost(self)

    def send(self, request: bytes, sent_for: float, measured: bool) -> None:
        assert self.transport is not None
        self.sent_for, self.measured = sent_for, measured
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            length = 0
            at = buf.find(b"content-length:", 0, end)
            if at >= 0:
                length = int(buf[at + 15 : buf.find(b"\r\n", at)])
            if len(buf) < end + 4 + length:
                break
            status = int(buf[9:12])
            buf = buf[end + 4 + length :]
            self.load.answered(self, status)
        self.buf = buf


class _Load:
    def __init__(self, run_id: str) -> None:
        self.requests = _Requests(run_id)
        self.latencies: array[float] = array("d")
        self.statuses: dict[int, int] = {}
        self.idle: list[_Connection] = []
        self.backlog: deque[float] = deque()
        self.open = 0
        self.in_flight = 0
        self.measure_from = 0.0
        self.stop_at = math.inf
        self.closed_loop = True
        self.finished: asyncio.Future[None] | None = None

    async def connect(self, port: int, connections: int) -> list[_Connection]:
        loop = asyncio.get_running_loop()
        made: list[_Connection] = []
        for _ in range(connections):
            _, conn = await loop.create_connection(lambda: _Connection(self), "127.0.0.1", port)
            made.append(conn)
        self.open = len(made)
        return made

    def send(self, conn: _Connection, sent_for: float, measured: bool) -> None:
        self.in_flight += 1
        conn.send(self.requests.next(), sent_for, measured)

    def answered(self, conn: _Connection, status: int) -> None:
        now = time.perf_counter()
        self.in_flight -= 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if conn.measured and status == 204:
            self.latencies.append(now - conn.sent_for)
        if self.closed_loop:
            if now < self.stop_at:
                self.send(conn, now, now >= self.measure_from)
            else:
                self._maybe_finished()
        elif self.backlog:
            self.send(conn, self.backlog.popleft(), True)
        else:
            self.idle.append(conn)
            self._maybe_finished()

    def lost(self, conn: _Connection) -> None:
        self.open -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        done = self.in_flight == 0 and not self.backlog and time.perf_counter() >= self.stop_at
        if (done or self.open == 0) and self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    async def closed(self, conns: list[_Connection], start: float, warmup: float,
                     seconds: float) -> None:  # fmt: skip
        """Every connection sends its next request when the last one is answered."""
        self.finished = asyncio.get_running_loop().create_future()
        self.measure_from, self.stop_at = start + warmup, start + warmup + seconds
        for conn in conns:
            self.send(conn, start, warmup <= 0)
        await self.finished

    async def open_loop(self, conns: list[_Connection], start: float, rate: float,
                        seconds: float) -> None:  # fmt: skip
        """Requests scheduled at ``rate`` per second whatever the answers, sent on an idle
        connection (or as soon as one is free); latency from the scheduled time."""
        self.closed_loop = False
        self.finished = asyncio.get_running_loop().create_future()
        self.idle = list(conns)
        total = int(rate * seconds)
        issued = 0
        while issued < total:
            now = time.perf_counter()
            due = min(total, int((now - start) * rate) + 1)
            while issued < due:
                scheduled = start + issued / rate
                issued += 1
                if self.idle:
                    self.send(self.idle.pop(), scheduled, True)
                else:
                    self.backlog.append(scheduled)
            # At least 1 ms: the loop's timers are not finer, and a shorter sleep spun a core
            # (the client took 85 % CPU at 5,000/s, competing with the server it measures); a
            # request sent late is measured from its scheduled time all the same.
            await asyncio.sleep(max(0.001, start + issued / rate - time.perf_counter()))
        self.stop_at = time.perf_counter()
        self._maybe_finished()
        await self.finished


async def _client(params: dict[str, Any]) -> dict[str, Any]:
    load = _Load(params["run_id"])
    conns = await load.connect(params["port"], params["connections"])
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    start_wall = float(sys.stdin.readline())  # every client process starts at this instant
    start = time.perf_counter() + (start_wall - time.time())
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    cpu = time.process_time()
    if params["mode"] == "closed":
        await load.closed(conns, start, params["warmup"], params["seconds"])
    else:
        await load.open_loop(conns, start, params["rate"], params["seconds"])
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    return {
        "window": params["seconds"],
        "latencies": list(load.latencies),
        "statuses": load.statuses,
        "cpu_s": time.process_time() - cpu,  # the run, warm-up included, not the start-up
    }


def client_main() -> int:
    """Entry of a load-generator process: parameters on the first stdin line, ``ready`` once
    connected, the start time (Unix seconds) on the next line, one JSON result on stdout."""
    import uvloop

    params = json.loads(sys.stdin.readline())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(_client(params))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


async def _spawn(entry: str) -> asyncio.subprocess.Process:
    """A child process running ``aivedio.bench.ingest.<entry>()``, JSON lines on its stdin and
    stdout (a client's result line holds every latency: up to 256 MiB)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        f"import sys; from aivedio.bench.ingest import {entry}; sys.exit({entry}())",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 28,
    )


async def _run_clients(processes: int, params: dict[str, Any]) -> dict[str, Any]:
    """Run the load in ``processes`` processes at once (connections and rate split between
    them, one run id each); their results merged."""
    procs = []
    for i in range(processes):
        share = params | {
            "connections": params["connections"] // processes
            + (1 if i < params["connections"] % processes else 0),
            "run_id": f"{params['run_id']}{i}",
        }
        if "rate" in params:
            share["rate"] = params["rate"] / processes
        proc = await _spawn("client_main")
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(json.dumps(share).encode() + b"\n")
        procs.append(proc)
    for proc in procs:
        assert proc.stdout is not None
        if (await proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError("a load generator did not connect")
    start = str(time.time() + 0.2).encode() + b"\n"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(start)
        await proc.stdin.drain()
    merged: dict[str, Any] = {
        "window": params["seconds"],
        "latencies": [],
        "statuses": {},
        "cpu_s": 0.0,
    }
    for proc in procs:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if await proc.wait() != 0 or not line:
            raise RuntimeError(f"load generator exited with {proc.returncode}")
        result = json.loads(line)
        merged["latencies"].extend(result["latencies"])
        merged["cpu_s"] += result["cpu_s"]
        for status, count in result["statuses"].items():
            merged["statuses"][status] = merged["statuses"].get(status, 0) + count
    return merged
