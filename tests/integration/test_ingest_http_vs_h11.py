"""The lean callback server's HTTP/1.1 message framing checked against h11 as a reference peer.

Hypothesis writes pipelined streams of signed callbacks whose framing varies (Content-Length,
chunked with odd chunk sizes, extensions and trailers, and the smuggling cases: both headers,
duplicate or signed lengths, obs-fold, other transfer codings). h11 parses each stream as a
server would; the lean server answers it on a real socket. They must agree request by request:
what h11 reads as a complete message with a body is answered 204 (its signature covers the body,
so a wrong boundary would be 401), and where h11 refuses, the server answers an error for that
request, stores nothing more and closes.

Where the two may differ it is named in ``STRICTER``: framings h11 reads but the server refuses
on purpose, as RFC 9112 allows (section 6.3: a server MAY reject a request with both
Content-Length and Transfer-Encoding, the classic smuggling vector, where h11 lets chunked win;
a Content-Length sent twice with one value, which h11 merges; obs-fold, which h11 unfolds and
RFC 9112 section 5.2 lets a server refuse with 400).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_ingest_lean_http import (
    Server,
    body_for,
    closed_by_server,
    read_answer,
    signed_head,
)
from tests.integration.test_ingest_lean_http import server as server  # the fixture

FRAMINGS = (
    "length",
    "chunked",
    "length+chunked",
    "chunked+length",
    "length,length",
    "length,other",
    "signed-length",
    "chunked-upper",
    "gzip,chunked",
    "obs-fold",
)

STRICTER = frozenset({"length+chunked", "chunked+length", "length,length", "obs-fold"})


@dataclass(frozen=True)
class Message:
    framing: str
    seq: int
    chunks: tuple[int, ...]  # chunk sizes for the chunked framings (0 ends the list)
    extension: bool
    trailer: bool


def _chunked(body: bytes, message: Message) -> bytes:
    out, at = [], 0
    for size in message.chunks:
        piece = body[at : at + size]
        if not piece:
            break
        ext = ";x=y" if message.extension else ""
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), ext.encode(), piece))
        at += len(piece)
    if at < len(body):
        out.append(b"%x\r\n%s\r\n" % (len(body) - at, body[at:]))
    out.append(b"0\r\n" + (b"x-trailer: t\r\n" if message.trailer else b"") + b"\r\n")
    return b"".join(out)


def encode(message: Message) -> bytes:
    body = body_for(message.seq)
    msg_id = f"msg_diff_{message.seq}"
    n = len(body)
    f = message.framing
    if f == "length":
        return signed_head(body, msg_id) + body
    if f == "signed-length":
        return signed_head(body, msg_id, length=-2).replace(b"-2\r\n", b"+%d\r\n" % n) + body
    if f == "length,length":
        return signed_head(body, msg_id, extra=f"content-length: {n}\r\n") + body
    if f == "length,other":
        return signed_head(body, msg_id, extra=f"content-length: {n + 1}\r\n") + body
    if f == "obs-fold":
        return signed_head(body, msg_id, extra="x-folded: a\r\n b\r\n") + body
    chunked = _chunked(body, message)
    if f == "chunked":
        return signed_head(body, msg_id, length=-1) + chunked
    if f == "chunked-upper":
        head = signed_head(body, msg_id, length=-1)
        return head.replace(b"transfer-encoding: chunked", b"Transfer-Encoding: Chunked") + chunked
    if f == "gzip,chunked":
        head = signed_head(body, msg_id, length=-1)
        return head.replace(b"chunked", b"gzip, chunked") + chunked
    if f == "length+chunked":
        return signed_head(body, msg_id, length=-1, extra=f"content-length: {n}\r\n") + chunked
    if f == "chunked+length":
        head = signed_head(body, msg_id, extra="transfer-encoding: chunked\r\n")
        return head + chunked
    raise AssertionError(f)


def h11_reads(stream: bytes) -> tuple[list[bytes], bool]:
    """The bodies of the complete messages h11 reads from ``stream``, and whether it refused
    the next one."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(stream)
    conn.receive_data(b"")
    bodies: list[bytes] = []
    body = b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return bodies, True
        if isinstance(event, h11.Request):
            body = b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            bodies.append(body)
            conn.send(h11.Response(status_code=204, headers=[]))
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()
        elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            return bodies, False
        else:
            raise AssertionError(event)


messages = st.builds(
    Message,
    framing=st.sampled_from(FRAMINGS),
    seq=st.integers(0, 0),  # set per position below
    chunks=st.lists(st.integers(1, 64), max_size=6).map(tuple),
    extension=st.booleans(),
    trailer=st.booleans(),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(messages, min_size=1, max_size=4), st.integers(0, 10**9))
async def test_the_server_frames_messages_as_h11_does(
    server: Server, stream_messages: list[Message], salt: int
) -> None:
    pipeline = [
        Message(m.framing, salt * 10 + i, m.chunks, m.extension, m.trailer)
        for i, m in enumerate(stream_messages)
    ]
    stream = b"".join(encode(m) for m in pipeline)
    bodies, refused = h11_reads(stream)
    assert bodies == [body_for(m.seq) for m in pipeline[: len(bodies)]]  # the reference itself
    stricter = [i for i, m in enumerate(pipeline[: len(bodies)]) if m.framing in STRICTER]
    if stricter:  # the server refuses there: h11's later messages are never read
        bodies, refused = bodies[: stricter[0]], True

    reader, writer = await server.connect()
    writer.write(stream)
    statuses: list[int] = []
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionResetError):
        for _ in range(len(bodies) + (1 if refused else 0)):
            statuses.append((await read_answer(reader)).status)
    assert statuses[: len(bodies)] == [204] * len(bodies), (pipeline, statuses)
    if refused:
        assert all(400 <= s < 500 for s in statuses[len(bodies) :]), (pipeline, statuses)
        assert await closed_by_server(reader)
    writer.close()


pytestmark = [
    pytest.mark.slow,
    # a failing example's report includes the server fixture's (long) repr
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]
