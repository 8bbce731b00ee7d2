"""The lean HTTP/1.1 callback path (``aivedio.ingest.http`` behind ``serve_http``'s sniffer) over
real sockets, against real PostgreSQL: keep-alive, pipelining (answers in order), 413 without
reading the rest, 408 for a slow body, an oversized head, HTTP/1.0, ``Expect: 100-continue``, a
malformed request, and a keep-alive connection that mixes callbacks with ordinary API requests.
The rejection table itself runs over this path in ``test_callback_gateway.py``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aivedio.api.http import TraceMiddleware
from aivedio.db.pool import Database
from aivedio.ingest.gateway import CallbackConfig, CallbackEndpoint, callback_routes
from aivedio.ingest.group_commit import InboxWriter
from aivedio.providers.standard_webhooks import StandardWebhooksJson
from aivedio.providers.verify import StandardWebhooksVerifier
from tests.integration.test_callback_gateway import lean_server

SECRET = "whsec_" + base64.b64encode(b"lean-http-test-secret-0123456789").decode()
KEY = base64.b64decode(SECRET.removeprefix("whsec_"))
LIMIT = 4096


def body_for(seq: int, pad: int = 0) -> bytes:
    data = {"id": f"gen_{seq}", "status": "running", "sequence": seq, "pad": "x" * pad}
    return json.dumps({"type": "generation.updated", "data": data}).encode()


def signed_head(body: bytes, msg_id: str | None = None, *, length: int | None = None,
                extra: str = "", path: str = "/v1/callbacks/sandbox",
                version: str = "HTTP/1.1") -> bytes:  # fmt: skip
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    ts = str(int(time.time()))
    mac = hmac.new(KEY, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    framing = (
        "transfer-encoding: chunked\r\n"
        if length == -1
        else f"content-length: {len(body) if length is None else length}\r\n"
    )
    return (
        f"POST {path} {version}\r\nhost: t\r\ncontent-type: application/json\r\n{framing}"
        f"webhook-id: {msg_id}\r\nwebhook-timestamp: {ts}\r\n"
        f"webhook-signature: v1,{base64.b64encode(mac).decode()}\r\n{extra}\r\n"
    ).encode()


def callback(seq: int, msg_id: str | None = None) -> bytes:
    body = body_for(seq)
    return signed_head(body, msg_id) + body


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), value.strip())
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), 5) if length else b""
    return Answer(status, headers, body)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionResetError:
        return True


@dataclass
class Server:
    port: int
    db: Database
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def keys(self) -> list[str]:
        async with self.db.connection() as conn:
            records = await conn.fetch("SELECT dedup_key FROM provider_callback_inbox ORDER BY id")
        return [r["dedup_key"] for r in records]


def make_app(writer: InboxWriter, read_timeout_s: float = 5.0) -> Starlette:
    provider = StandardWebhooksJson(
        "sandbox", StandardWebhooksVerifier([("v1", SECRET)]), max_body_bytes=LIMIT
    )

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def echo(request: Request) -> Response:
        return JSONResponse({"got": len(await request.body())})

    routes = [
        *callback_routes(
            CallbackConfig(read_timeout_s=read_timeout_s), {"sandbox": provider}, writer
        ),
        Route("/healthz", healthz),
        Route("/echo", echo, methods=["POST"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(TraceMiddleware)])


@pytest.fixture
async def server(db: Database) -> AsyncIterator[Server]:
    writer = InboxWriter(db)
    writer.start()
    try:
        async with lean_server(make_app(writer)) as port:
            server = Server(port, db)
            yield server
            await server.close()
    finally:
        await writer.close()


@pytest.fixture
async def slow_server(db: Database) -> AsyncIterator[Server]:
    writer = InboxWriter(db)
    writer.start()
    try:
        async with lean_server(make_app(writer, read_timeout_s=0.3), timeout_keep_alive=1) as port:
            server = Server(port, db)
            yield server
            await server.close()
    finally:
        await writer.close()


async def test_keep_alive_serves_many_callbacks_on_one_connection(server: Server) -> None:
    reader, writer = await server.connect()
    for seq in range(5):
        writer.write(callback(seq, f"msg_ka_{seq}"))
        answer = await read_answer(reader)
        assert answer.status == 204
        assert answer.headers["x-trace-id"].startswith("trc_")
        assert "date" in answer.headers
        assert "connection" not in answer.headers
    writer.close()
    assert await server.keys() == [f"msg_ka_{seq}" for seq in range(5)]


async def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    forged = body_for(99)
    bad = signed_head(forged, "msg_forged").replace(b"v1,", b"v1,AAAA", 1) + forged
    requests = [callback(seq, f"msg_p_{seq}") for seq in range(20)]
    requests.insert(5, bad)  # 401 between 204s
    requests.insert(10, callback(3, "msg_p_3"))  # a duplicate: 204, no new row
    reader, writer = await server.connect()
    writer.write(b"".join(requests))  # one write: all pipelined
    statuses = [(await read_answer(reader)).status for _ in requests]
    assert statuses == [204] * 5 + [401] + [204] * 16
    writer.close()
    assert sorted(await server.keys()) == sorted(f"msg_p_{seq}" for seq in range(20))


async def test_content_length_over_the_limit_is_413_without_reading_the_body(
    server: Server,
) -> None:
    reader, writer = await server.connect()
    writer.write(signed_head(b"{}", length=LIMIT + 1))  # the body is never sent
    answer = await read_answer(reader)
    assert answer.status == 413
    assert json.loads(answer.body)["error"]["code"] == "body_too_large"
    assert answer.headers["connection"] == "close"
    assert await closed_by_server(reader)
    assert await server.keys() == []


async def test_chunked_body_over_the_limit_is_413_and_reading_stops(server: Server) -> None:
    reader, writer = await server.connect()
    writer.write(signed_head(b"{}", length=-1))
    answer_task = asyncio.create_task(read_answer(reader))
    sent = 0
    with contextlib.suppress(ConnectionError):  # the server stops reading and closes
        for _ in range(2000):  # 2 MB if it were all read
            writer.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
            await writer.drain()
            sent += 1000
            await asyncio.sleep(0)
            if answer_task.done():
                break
    answer = await answer_task
    assert answer.status == 413
    assert answer.headers["connection"] == "close"
    assert sent < 1_000_000
    assert await server.keys() == []


async def test_slow_body_is_408_and_the_connection_closes(slow_server: Server) -> None:
    body = body_for(1)
    reader, writer = await slow_server.connect()
    writer.write(signed_head(body) + body[:10])
    answer = await read_answer(reader)  # the body timeout's answer, not a timing measurement
    assert answer.status == 408
    assert json.loads(answer.body)["error"]["code"] == "request_timeout"
    assert await closed_by_server(reader)
    assert await slow_server.keys() == []


async def test_idle_keep_alive_connection_is_closed(slow_server: Server) -> None:
    reader, writer = await slow_server.connect()
    writer.write(callback(1))
    assert (await read_answer(reader)).status == 204
    assert await closed_by_server(reader)  # by uvicorn's timeout_keep_alive (1 s here)


async def test_oversized_head_is_431_and_closes(server: Server) -> None:
    body = body_for(1)
    reader, writer = await server.connect()
    writer.write(signed_head(body, extra="x-big: " + "v" * 40_000 + "\r\n") + body)
    answer = await read_answer(reader)
    assert answer.status == 431
    assert json.loads(answer.body)["error"]["code"] == "headers_too_large"
    assert answer.headers["connection"] == "close"
    assert await closed_by_server(reader)
    assert await server.keys() == []


async def test_too_many_headers_is_431(server: Server) -> None:
    body = body_for(1)
    extra = "".join(f"x-h{i}: v\r\n" for i in range(80))
    reader, writer = await server.connect()
    writer.write(signed_head(body, extra=extra) + body)
    answer = await read_answer(reader)
    assert answer.status == 431
    assert answer.headers["connection"] == "close"  # its body was not read
    assert await server.keys() == []


async def test_refusals_on_the_head(server: Server) -> None:
    reader, writer = await server.connect()
    body = body_for(1)
    writer.write(signed_head(body, path="/v1/callbacks/nobody") + body)
    answer = await read_answer(reader)
    assert answer.status == 404
    assert json.loads(answer.body)["error"]["code"] == "not_found"
    assert answer.headers["connection"] == "close"  # a body that is not read ends it
    writer.close()

    reader, writer = await server.connect()
    head = signed_head(body).replace(b"application/json", b"text/plain")
    writer.write(head + body)
    answer = await read_answer(reader)
    assert answer.status == 415
    writer.close()

    reader, writer = await server.connect()
    writer.write(callback(1, "msg_then_get"))
    assert (await read_answer(reader)).status == 204
    writer.write(b"GET /v1/callbacks/sandbox HTTP/1.1\r\nhost: t\r\n\r\n")  # no body: kept
    answer = await read_answer(reader)
    assert answer.status == 405
    assert answer.headers["allow"] == "POST"
    writer.write(callback(2, "msg_after_405"))
    assert (await read_answer(reader)).status == 204
    writer.close()
    assert await server.keys() == ["msg_then_get", "msg_after_405"]


async def test_malformed_request_is_400_and_closes(server: Server) -> None:
    reader, writer = await server.connect()
    writer.write(b"POST /v1/callbacks/sandbox HTTP/1.1\r\ncontent-length: abc\r\n\r\n")
    answer = await read_answer(reader)
    assert answer.status == 400
    assert json.loads(answer.body)["error"]["code"] == "bad_request"
    assert await closed_by_server(reader)


async def test_http_10_without_keep_alive_closes_after_the_answer(server: Server) -> None:
    body = body_for(1)
    reader, writer = await server.connect()
    writer.write(signed_head(body, "msg_http10", version="HTTP/1.0") + body)
    answer = await read_answer(reader)
    assert answer.status == 204
    assert answer.headers["connection"] == "close"
    assert await closed_by_server(reader)
    assert await server.keys() == ["msg_http10"]


async def test_expect_100_continue(server: Server) -> None:
    body = body_for(1)
    reader, writer = await server.connect()
    writer.write(signed_head(body, "msg_expect", extra="expect: 100-continue\r\n"))
    interim = await read_answer(reader)
    assert interim.status == 100
    writer.write(body)
    assert (await read_answer(reader)).status == 204
    assert await server.keys() == ["msg_expect"]


async def test_trace_id_comes_from_traceparent(server: Server) -> None:
    body = body_for(1)
    trace = "0af7651916cd43dd8448eb211c80319c"
    extra = f"traceparent: 00-{trace}-b7ad6b7169203331-01\r\n"
    reader, writer = await server.connect()
    writer.write(signed_head(body, "msg_traced", extra=extra) + body)
    answer = await read_answer(reader)
    assert answer.headers["x-trace-id"] == f"trc_{trace}"
    async with server.db.connection() as conn:
        assert await conn.fetchval("SELECT trace_id FROM provider_callback_inbox") == (
            f"trc_{trace}"
        )


async def test_keep_alive_connection_mixes_callbacks_and_api_requests(server: Server) -> None:
    reader, writer = await server.connect()
    writer.write(callback(1, "msg_mix_1"))
    assert (await read_answer(reader)).status == 204
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")  # to uvicorn, same socket
    answer = await read_answer(reader)
    assert answer.status == 200
    assert json.loads(answer.body) == {"status": "ok"}
    writer.write(callback(2, "msg_mix_2"))  # and back to the lean path
    assert (await read_answer(reader)).status == 204
    # pipelined: a callback, an API POST with a body, a callback, in one write
    echo = b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\n\r\nhello"
    writer.write(callback(3, "msg_mix_3") + echo + callback(4, "msg_mix_4"))
    answers = [await read_answer(reader) for _ in range(3)]
    assert [a.status for a in answers] == [204, 200, 204]
    assert json.loads(answers[1].body) == {"got": 5}
    writer.close()
    assert await server.keys() == [f"msg_mix_{i}" for i in range(1, 5)]


async def test_many_concurrent_connections_group_their_rows(server: Server) -> None:
    async def one(i: int) -> list[int]:
        reader, writer = await server.connect()
        statuses = []
        for j in range(5):
            writer.write(callback(i * 10 + j, f"msg_c_{i}_{j}"))
            statuses.append((await read_answer(reader)).status)
        writer.close()
        return statuses

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert all(s == [204] * 5 for s in results)
    assert len(await server.keys()) == 150


@pytest.mark.parametrize("where", ["checks", "answer"])
async def test_a_bug_on_the_way_answers_500_in_order_and_the_connection_goes_on(
    server: Server, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A bug in the checks (before the row is queued) or in building the answer (after the
    commit) is a 500 for that callback alone: never a 2xx, never a request left unanswered."""
    calls = 0

    def broken(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # the second callback of the connection only
                raise RuntimeError("a bug")
            return original(*args, **kwargs)

        return call

    name = "_prepare" if where == "checks" else "_stored"
    monkeypatch.setattr(CallbackEndpoint, name, broken(getattr(CallbackEndpoint, name)))
    reader, writer = await server.connect()
    writer.write(b"".join(callback(seq, f"msg_bug_{seq}") for seq in range(3)))  # pipelined
    statuses = [(await read_answer(reader)).status for _ in range(3)]
    assert statuses == [204, 500, 204]
    stored = await server.keys()
    if where == "checks":
        assert stored == ["msg_bug_0", "msg_bug_2"]  # nothing queued for the failed one
    else:
        assert sorted(stored) == ["msg_bug_0", "msg_bug_1", "msg_bug_2"]  # committed; a retry
        # of msg_bug_1 is a duplicate and answers 204
        writer.write(callback(1, "msg_bug_1"))
        assert (await read_answer(reader)).status == 204
