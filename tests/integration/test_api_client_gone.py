"""A client that goes away before its request body arrived is not an error of the app: the
production server (``serve_http``) logs its request line with status 499 and no ASGI traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aivedio.api.http import TraceMiddleware, read_json
from tests.integration.test_callback_gateway import lean_server
from tests.waiting import eventually


async def echo(request: Request) -> JSONResponse:
    return JSONResponse(await read_json(request, 1 << 16))


def app() -> Starlette:
    return Starlette(
        routes=[Route("/echo", echo, methods=["POST"])], middleware=[Middleware(TraceMiddleware)]
    )


async def test_a_client_gone_before_its_body_is_a_499_line_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with lean_server(app()) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"half": '
        )
        await writer.drain()

        def lines() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "aivedio.api" and r.msg == "request"]

        writer.close()  # the head is sent; the body never completes (either order of the server's
        # reading and its seeing the close gives the handler a disconnect)
        await writer.wait_closed()
        await eventually(lambda: bool(lines()), "the request line", 10, interval=0.01)
        # a whole request on a new connection still works
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 11\r\nConnection: close\r\n\r\n{"a": [1]}\n'
        )
        answer = await reader.read()
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
    assert [getattr(r, "fields", {}).get("status") for r in lines()] == [499, 200]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
