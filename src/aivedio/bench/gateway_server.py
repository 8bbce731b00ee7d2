"""The gateway under test, in a process of its own (so its RSS and CPU are its own).

``python -m aivedio.bench.gateway_server --database-url URL --redis-url URL --channel C ...``
serves the real SSE path (``serve_http`` + ``Gateway``) and a one-route Starlette app on a free
port, prints one JSON line ``{"port", "pid"}`` once the gateway is subscribed to Redis, and runs
until SIGTERM/SIGINT. Open files are raised to the hard limit first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aivedio.bench.sse_load import raise_open_files
from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.gateway import Gateway, GatewayConfig
from aivedio.logs import setup_logging
from aivedio.process.http_server import serve_http

BIG = 10_000_000  # per-user/tenant connection limits and connect rate: not what is measured


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aivedio.bench.gateway_server")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--channel", required=True)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--heartbeat-s", type=float, default=20.0)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    return parser.parse_args(argv)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        redis_url=args.redis_url,
        channel=args.channel,
        key_prefix=args.key_prefix,
        heartbeat_s=args.heartbeat_s,
        max_conns_per_user=BIG,
        max_conns_per_tenant=BIG,
        connect_rate_per_s=float(BIG),
        connect_burst=BIG,
        drain_s=0.5,
    )


async def serve(args: argparse.Namespace) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[Route("/healthz", healthz)])
    db = await Database.connect(
        DatabaseConfig(url=args.database_url, min_size=2, max_size=args.pool, acquire_timeout_s=30)
    )
    try:
        gateway = Gateway(db, gateway_config(args))
        port = args.port or free_port(args.host)
        server = asyncio.create_task(serve_http(app, args.host, port, gateway, stopping))
        subscribed = asyncio.create_task(gateway.wait_subscribed())
        await asyncio.wait({server, subscribed}, return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            subscribed.cancel()
            await server  # it failed before the gateway subscribed: raise its error
            return
        await _wait_listening(args.host, port, server)
        print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)
        await server
    finally:
        await db.close()


async def _wait_listening(host: str, port: int, server: asyncio.Task[None]) -> None:
    while not server.done():
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        await writer.wait_closed()
        return


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``asyncio``: the standard loop (what ``aivedio run`` uses today); ``uvloop``: libuv's."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    raise_open_files()
    setup_logging("WARNING")
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(serve(args))


if __name__ == "__main__":
    main()
