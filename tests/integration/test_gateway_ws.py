"""The WebSocket endpoint end to end: RFC handshake, documented frames, exact resume, gap repair,
Origin and tenant checks, protocol violations, commands, slow eviction, seed 004."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import struct
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin

from aivedio.client import StreamRefused
from aivedio.domain.observation import ProviderStatus
from aivedio.gateway import wsframes
from tests.integration.helpers import make_project
from tests.integration.test_gateway_backpressure import closes
from tests.integration.test_gateway_harness import (
    Env,
    EnvFactory,
    collect,
    make_env,
    open_stalled,
    seqs,
)
from tests.waiting import eventually

__all__ = ["make_env"]

PUBLIC_PAYLOAD = {"status", "stage", "progress", "asset_id", "error"}


def ws_url(env: Env, query: str = "") -> str:
    base = env.base_url.replace("http://", "ws://")
    return f"{base}/v1/projects/{env.project.project_id}/ws{query}"


async def open_ws(env: Env, query: str = "", **kw: Any) -> ClientConnection:
    headers = kw.pop("headers", {"Authorization": f"Bearer {env.project.api_key}"})
    return await connect(
        ws_url(env, query), additional_headers=headers, compression=None, proxy=None, **kw
    )


async def recv_json(ws: ClientConnection, timeout: float = 10.0) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return message


async def recv_until(
    ws: ClientConnection, kind: str, timeout: float = 15.0
) -> list[dict[str, Any]]:
    """Messages up to and including the first of ``kind`` (bounded wait)."""
    got: list[dict[str, Any]] = []
    while not got or got[-1]["type"] != kind:
        got.append(await recv_json(ws, timeout))
    return got


async def task_events(ws: ClientConnection, n: int, timeout: float = 15.0) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    while len(got) < n:
        message = await recv_json(ws, timeout)
        if message["type"] == "task.status":
            got.append(message)
    return got


# -- raw sockets (protocol violations) -----------------------------------------------------


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def send(self, opcode: int, payload: bytes, *, mask: bool = True) -> None:
        n = len(payload)
        b1 = 0x80 if mask else 0
        if n < 126:
            header = bytes((0x80 | opcode, b1 | n))
        else:
            header = struct.pack("!BBH", 0x80 | opcode, b1 | 126, n)
        if mask:
            key = os.urandom(4)
            payload = key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))
        self.writer.write(header + payload)

    async def frame(self, timeout: float = 10.0) -> tuple[int, bytes]:
        head = await asyncio.wait_for(self.reader.readexactly(2), timeout)
        n = head[1] & 0x7F
        if n == 126:
            n = int.from_bytes(await self.reader.readexactly(2), "big")
        elif n == 127:
            n = int.from_bytes(await self.reader.readexactly(8), "big")
        return head[0] & 0x0F, await self.reader.readexactly(n)

    async def close_code(self, timeout: float = 15.0) -> int:
        """Read until the server's close frame; its code."""
        while True:
            opcode, payload = await self.frame(timeout)
            if opcode == wsframes.OP_CLOSE:
                return int.from_bytes(payload[:2], "big")


async def raw_handshake(env: Env, *headers: str, key: str | None = None) -> tuple[Raw, bytes]:
    host, port = env.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = key or base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET /v1/projects/{env.project.project_id}/ws HTTP/1.1",
        f"Host: {host}:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Version: 13",
        f"Sec-WebSocket-Key: {key}",
        *headers,
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return Raw(reader, writer), head


async def delivered(env: Env, seq: int) -> None:
    """Wait (bounded) until the gateway's project stream has dispatched ``seq``."""

    def dispatched() -> bool:
        stream = env.gateway.hub.streams.get(env.project.project_id)
        return stream is not None and stream.last >= seq

    await eventually(dispatched, f"seq {seq} to reach the gateway", 10)


def bearer(env: Env) -> str:
    return f"Authorization: Bearer {env.project.api_key}"


# -- tests -----------------------------------------------------------------------------------


async def test_handshake_follows_the_rfc_and_negotiates_no_compression(
    make_env: EnvFactory,
) -> None:
    env = await make_env()
    raw, head = await raw_handshake(
        env,
        bearer(env),
        "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits",
        key="dGhlIHNhbXBsZSBub25jZQ==",
    )
    assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert b"Upgrade: websocket\r\n" in head
    assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in head  # RFC 6455 §1.3
    assert b"Sec-WebSocket-Extensions" not in head
    opcode, payload = await raw.frame()
    assert opcode == wsframes.OP_TEXT and json.loads(payload)["type"] == "start"
    raw.send(wsframes.OP_PING, b"hello")
    assert await raw.frame() == (wsframes.OP_PONG, b"hello")
    raw.send(wsframes.OP_CLOSE, (1000).to_bytes(2, "big"))
    assert await raw.close_code() == 1000
    raw.writer.close()


async def test_frames_are_exactly_as_documented(make_env: EnvFactory) -> None:
    env = await make_env()
    ws = await open_ws(env)
    start = await recv_json(ws)
    epoch, head = await env.head()
    assert start == {"type": "start", "cursor": f"{epoch}-{head}"}
    task, attempt = await env.new_task()
    await env.provider(attempt, ProviderStatus.RUNNING, progress=30)
    got = await task_events(ws, 2)
    assert set(got[0]) == {"type", "event_id", "cursor", "task_id", "task_version", "payload"}
    assert set(got[0]["payload"]) == PUBLIC_PAYLOAD
    assert got[0]["event_id"] == 1 and got[0]["cursor"] == f"{epoch}-1"
    assert got[0]["task_id"] == str(task) and got[0]["payload"]["status"] == "queued"
    assert got[1]["event_id"] == 2 and got[1]["payload"]["progress"] == 30
    assert got[1]["task_version"] > got[0]["task_version"]
    await ws.close()


async def test_resume_with_events_committed_during_the_replay_is_exact(
    make_env: EnvFactory,
) -> None:
    env = await make_env(replay_page=20, replay_cap=1000)
    for _ in range(300):
        await env.new_task()
    epoch, _ = await env.head()

    async def write_more() -> None:
        for _ in range(150):
            await env.new_task()

    client = env.client(transport="ws")
    client.view.cursor = f"{epoch}-0"
    writer = asyncio.create_task(write_more())
    await asyncio.sleep(0.05)  # commits are under way while the client replays
    got = await collect(client.connect_once(), lambda fs: len(seqs(fs)) >= 450, timeout=60)
    await writer
    assert seqs(got) == list(range(1, 451))
    await client.aclose()


async def test_reset_frame_for_a_cursor_of_another_epoch(make_env: EnvFactory) -> None:
    env = await make_env()
    for _ in range(3):
        await env.new_task()
    epoch, head = await env.head()
    ws = await open_ws(env, f"?after={epoch + 1}-2")
    assert await recv_json(ws) == {
        "type": "reset",
        "reason": "other_epoch",
        "cursor": f"{epoch}-{head}",
    }
    await env.new_task()
    assert [m["event_id"] for m in await task_events(ws, 1)] == [head + 1]
    await ws.close()


async def test_lost_redis_messages_are_repaired_for_websocket_clients(
    make_env: EnvFactory,
) -> None:
    env = await make_env()
    total = 30
    env.publisher.drop = lambda seq: seq % 3 == 0 or seq == total  # the LAST one too
    clients = [env.client(transport="ws") for _ in range(3)]
    for client in clients:
        await client.snapshot()
    streams = [client.connect_once() for client in clients]
    readers = [
        asyncio.ensure_future(collect(s, lambda fs: len(seqs(fs)) >= total)) for s in streams
    ]
    await env.joined(3)
    for _ in range(total):
        await env.new_task()
    for got in await asyncio.gather(*readers):
        assert seqs(got) == list(range(1, total + 1))
    assert total in env.publisher.dropped
    for client in clients:
        await client.aclose()


async def test_a_foreign_origin_is_refused_before_the_upgrade(make_env: EnvFactory) -> None:
    env = await make_env(ws_allowed_origins=("http://app.example",))
    client = env.client()
    token = await client.stream_token()
    refused = [
        ({"Authorization": f"Bearer {env.project.api_key}"}, "http://evil.example"),
        ({}, "http://evil.example"),
        ({"Cookie": f"aivedio_stream_token={token}"}, None),  # no Origin with the cookie
    ]
    for headers, origin in refused:
        with pytest.raises(InvalidStatus) as info:
            await open_ws(env, headers=headers, origin=Origin(origin) if origin else None)
        assert info.value.response.status_code == 403
        assert json.loads(info.value.response.body)["error"]["code"] == "origin_not_allowed"
    await env.new_task()  # nothing was delivered to any of them: none was upgraded
    # The allowed Origin with the cookie works; so does a server-side client with its key.
    ok = await open_ws(
        env,
        headers={"Cookie": f"aivedio_stream_token={await client.stream_token()}"},
        origin=Origin("http://app.example"),
    )
    assert (await recv_json(ok))["type"] == "start"
    await ok.close()
    await client.aclose()


async def test_cross_tenant_is_refused_and_receives_nothing(make_env: EnvFactory) -> None:
    env = await make_env()
    other = await make_project(env.db, tenant="intruder-ws", project="web")
    intruder = env.client(api_key=other.api_key, transport="ws")
    with pytest.raises(StreamRefused) as info:
        async for _ in intruder.connect_once():
            pass
    assert info.value.status == 404  # like a project that does not exist
    own = env.client(api_key=other.api_key, project_id=other.project_id)
    token = await own.stream_token()
    with pytest.raises(InvalidStatus) as status:
        await open_ws(env, f"?token={token}", headers={}, origin=Origin(env.base_url))
    assert status.value.response.status_code == 404
    assert json.loads(status.value.response.body)["error"]["code"] == "not_found"
    await intruder.aclose()
    await own.aclose()


async def test_violations_close_with_protocol_codes(make_env: EnvFactory) -> None:
    env = await make_env()
    oversize, _ = await raw_handshake(env, bearer(env))
    oversize.send(wsframes.OP_TEXT, b"x" * 5000)
    assert await oversize.close_code() == 1009
    unmasked, _ = await raw_handshake(env, bearer(env))
    unmasked.send(wsframes.OP_TEXT, b'{"type":"subscribe","request_id":1}', mask=False)
    assert await unmasked.close_code() == 1002
    for raw in (oversize, unmasked):
        raw.writer.close()


async def test_a_missing_pong_closes_the_connection(
    make_env: EnvFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aivedio.gateway")
    env = await make_env(heartbeat_s=1.0)
    raw, _ = await raw_handshake(env, bearer(env))  # reads, but never answers a ping
    pings = 0
    while True:
        opcode, payload = await raw.frame(timeout=15)
        if opcode == wsframes.OP_PING:
            pings += 1
        if opcode == wsframes.OP_CLOSE:
            break
    assert int.from_bytes(payload[:2], "big") == 4006 and payload[2:] == b"ping_timeout"
    assert pings >= 1
    await eventually(lambda: closes(caplog, "ping_timeout"), "the ping_timeout close logged", 5)
    assert len(closes(caplog, "ping_timeout")) == 1
    raw.writer.close()


async def test_a_client_that_answers_pings_stays(make_env: EnvFactory) -> None:
    env = await make_env(heartbeat_s=1.0)
    ws = await open_ws(env, ping_interval=None)  # websockets answers server pings by itself
    await recv_json(ws)
    await asyncio.sleep(3.5)  # several heartbeat periods
    await env.new_task()
    assert [m["event_id"] for m in await task_events(ws, 1)] == [1]
    await ws.close()


async def test_commands_are_answered_by_request_id(make_env: EnvFactory) -> None:
    env = await make_env()
    ws = await open_ws(env)
    await recv_json(ws)  # start
    a, attempt_a = await env.new_task()
    b, _ = await env.new_task()
    assert [m["event_id"] for m in await task_events(ws, 2)] == [1, 2]

    await ws.send(json.dumps({"type": "subscribe", "request_id": "s1", "task_id": str(a)}))
    assert await recv_json(ws) == {"type": "ack", "request_id": "s1"}
    await env.new_task()  # another task: filtered out
    await env.provider(attempt_a, ProviderStatus.RUNNING, progress=10)
    got = await task_events(ws, 1)
    assert [(m["event_id"], m["task_id"]) for m in got] == [(4, str(a))]

    await ws.send(json.dumps({"type": "unsubscribe", "request_id": 2}))
    assert await recv_json(ws) == {"type": "ack", "request_id": 2}
    await env.new_task()  # seq 5: not written
    await delivered(env, 5)
    await ws.send(json.dumps({"type": "subscribe", "request_id": "s3"}))
    assert await recv_json(ws) == {"type": "ack", "request_id": "s3"}
    await env.new_task()  # seq 6: written (all tasks again)
    assert [m["event_id"] for m in await task_events(ws, 1)] == [6]

    epoch, _ = await env.head()
    await ws.send(json.dumps({"type": "resume", "request_id": "r", "after": f"{epoch}-3"}))
    assert await recv_json(ws) == {"type": "ack", "request_id": "r"}
    assert [m["event_id"] for m in await task_events(ws, 3)] == [4, 5, 6]
    await env.new_task()
    assert [m["event_id"] for m in await task_events(ws, 1)] == [7]

    for command, request_id, code in (
        ({"type": "cancel", "request_id": "c", "task_id": str(b)}, "c", "unsupported_command"),
        ({"type": "retry", "request_id": "t", "task_id": str(b)}, "t", "unsupported_command"),
        ({"type": "resume", "request_id": "x", "after": "nope"}, "x", "bad_request"),
        ({"type": "subscribe"}, None, "bad_command"),
    ):
        await ws.send(json.dumps(command))
        reply = await recv_json(ws)
        assert (reply["type"], reply["request_id"], reply["code"]) == ("error", request_id, code)
    await ws.close()


async def test_stalled_client_is_evicted_as_slow_while_another_keeps_receiving(
    make_env: EnvFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aivedio.gateway")
    env = await make_env(
        heartbeat_s=30.0,  # no pings: the stalled client would not answer them either
        socket_send_buffer=4096,
        write_high_water=4096,
        write_low_water=1024,
        queue_max_events=8,
        queue_max_bytes=4096,
        stall_timeout_s=3.0,
    )
    stalled = await open_stalled(
        env.base_url,
        f"GET /v1/projects/{env.project.project_id}/ws HTTP/1.1\r\nHost: x\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
        f"Authorization: Bearer {env.project.api_key}\r\n\r\n",
    )
    healthy = env.client(transport="ws")
    await healthy.snapshot()
    stream = healthy.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 300, timeout=60))
    await env.joined(2)  # the stalled one too
    for _ in range(300):
        await env.new_task()
    got = await reader
    assert seqs(got) == list(range(1, 301))
    await eventually(lambda: closes(caplog, "slow"), "the slow close logged", 10)
    slow = closes(caplog, "slow")
    assert len(slow) == 1 and slow[0].fields["transport"] == "ws"  # type: ignore[attr-defined]
    stalled.close()
    await healthy.aclose()


async def test_a_finished_task_does_not_close_the_stream(make_env: EnvFactory) -> None:
    """Seed 004: one item's completion closed the whole stream."""
    env = await make_env()
    client = env.client(transport="ws")
    await client.snapshot()
    frames = client.connect_once()
    _, attempt = await env.new_task()
    await env.provider(attempt, ProviderStatus.FAILED, error_code="content_rejected")
    got = await collect(frames, lambda fs: any(f.data.get("status") == "failed" for f in fs))
    await env.new_task()  # the same connection still delivers the next task's events
    got += await collect(frames, lambda fs: len(seqs(fs)) >= 1)
    assert seqs(got) == [1, 2, 3]
    assert client.connects == 1
    await frames.aclose()  # type: ignore[attr-defined]
    await client.aclose()


async def test_shutdown_closes_with_a_reconnect_code(make_env: EnvFactory) -> None:
    env = await make_env(drain_s=0.1)
    ws = await open_ws(env)
    await recv_json(ws)
    await env.gateway.drain()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 4000 and ws.close_reason == "shutdown"
