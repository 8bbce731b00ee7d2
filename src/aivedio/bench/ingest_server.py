"""The server under test of ``aivedio bench ingest``: the production HTTP server in this process or
in ``server_processes`` processes sharing one port (``server_main``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware

from aivedio.api.http import TraceMiddleware
from aivedio.bench.ingest_load import _spawn
from aivedio.bench.ingest_options import PROVIDER, SECRET, IngestOptions
from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.ingest.gateway import CallbackConfig, callback_routes
from aivedio.ingest.group_commit import GroupCommitConfig, InboxWriter
from aivedio.process.http_server import serve_http
from aivedio.providers.standard_webhooks import StandardWebhooksJson
from aivedio.providers.verify import StandardWebhooksVerifier

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
