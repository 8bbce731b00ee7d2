"""The WebSocket pieces without sockets: RFC 6455 codec, frames, close codes, commands, handshake
parsing and the Origin allow-list."""

from __future__ import annotations

import json
import os
import struct
import uuid

import pytest

from aivedio.gateway import frames, wsframes
from aivedio.gateway.closecodes import (
    WS_RECONNECT_RANGE,
    WS_TERMINAL_RANGE,
    CloseReason,
)
from aivedio.gateway.commands import Command, CommandError, parse_command
from aivedio.gateway.frames import make_event
from aivedio.gateway.protocol import (
    BadRequest,
    Cursor,
    UpgradeRequired,
    origin_allowed,
    parse_head,
)
from aivedio.gateway.websocket import ws_frame

T1 = str(uuid.uuid4())
KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def client_frame(
    opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True, rsv: int = 0
) -> bytes:
    """A client frame as a browser sends it (masked unless told otherwise)."""
    b0 = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    if n < 126:
        header = bytes((b0, (0x80 if mask else 0) | n))
    elif n < 1 << 16:
        header = struct.pack("!BBH", b0, (0x80 if mask else 0) | 126, n)
    else:
        header = struct.pack("!BBQ", b0, (0x80 if mask else 0) | 127, n)
    if not mask:
        return header + payload
    key = os.urandom(4)
    return header + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def test_accept_key_is_the_rfc_example() -> None:
    assert wsframes.accept_key(KEY) == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455 §1.3
    response = wsframes.handshake_response(KEY).decode()
    assert response.startswith("HTTP/1.1 101 Switching Protocols\r\n")
    assert "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in response
    assert "Sec-WebSocket-Extensions" not in response  # no compression is negotiated


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536])
def test_server_frames_use_the_shortest_length_and_no_mask(size: int) -> None:
    frame = wsframes.text(b"x" * size)
    assert frame[0] == 0x81 and not frame[1] & 0x80
    header = 2 if size < 126 else 4 if size < 65536 else 10
    assert len(frame) == header + size


def test_parse_unmasks_and_waits_for_partial_frames() -> None:
    data = client_frame(wsframes.OP_TEXT, b'{"a":1}') + client_frame(wsframes.OP_PING, b"p")
    for cut in range(len(data)):
        got, used = wsframes.parse_frames(data[:cut], 4096)
        assert used <= cut
    got, used = wsframes.parse_frames(data, 4096)
    assert used == len(data)
    assert got == [(True, wsframes.OP_TEXT, b'{"a":1}'), (True, wsframes.OP_PING, b"p")]
    big = client_frame(wsframes.OP_TEXT, b"y" * 3000)
    assert wsframes.parse_frames(big, 4096) == ([(True, 1, b"y" * 3000)], len(big))


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (client_frame(wsframes.OP_TEXT, b"hi", mask=False), CloseReason.PROTOCOL_ERROR),
        (client_frame(wsframes.OP_TEXT, b"hi", rsv=0x40), CloseReason.PROTOCOL_ERROR),
        (client_frame(0x3, b"hi"), CloseReason.PROTOCOL_ERROR),
        (client_frame(wsframes.OP_PING, b"p", fin=False), CloseReason.PROTOCOL_ERROR),
        (client_frame(wsframes.OP_PING, b"p" * 126), CloseReason.PROTOCOL_ERROR),
        # Refused from the header alone: only 16 bytes of a 5,000-byte frame were sent.
        (client_frame(wsframes.OP_TEXT, b"z" * 5000)[:16], CloseReason.MESSAGE_TOO_BIG),
    ],
)
def test_parse_refuses_violations(frame: bytes, reason: CloseReason) -> None:
    with pytest.raises(wsframes.Violation) as info:
        wsframes.parse_frames(frame, 4096)
    assert info.value.reason is reason


def test_event_frames_are_the_documented_json_and_encoded_once() -> None:
    event = make_event(
        5,
        9,
        {
            "task_id": T1,
            "task_version": 2,
            "status": "running",
            "stage": "generating",
            "progress": 40,
            "cost": 3,
        },
    )
    frame = ws_frame(event)
    assert ws_frame(event) is frame  # cached on the event: once per node, not per connection
    assert frame[0] == 0x81 and frame[1] == 126  # FIN + text, 16-bit length, no mask
    assert int.from_bytes(frame[2:4], "big") == len(frame) - 4
    assert json.loads(frame[4:]) == {
        "type": "task.status",
        "event_id": 9,
        "cursor": "5-9",
        "task_id": T1,
        "task_version": 2,
        "payload": {
            "status": "running",
            "stage": "generating",
            "progress": 40,
            "asset_id": None,
            "error": None,
        },
    }
    assert frames.ws_message(frames.reset_event(5, 12, "below_floor")) == {
        "type": "reset",
        "reason": "below_floor",
        "cursor": "5-12",
    }
    assert frames.ws_message(frames.start_event(5, 12)) == {"type": "start", "cursor": "5-12"}


def test_close_codes_map_to_websocket_ranges() -> None:
    for reason in CloseReason:
        code = reason.ws_code
        if reason.label in (
            "protocol_error",
            "unsupported_data",
            "invalid_data",
            "message_too_big",
        ):
            assert code in (1002, 1003, 1007, 1009)
            assert not reason.reconnect
        else:
            assert code == reason.code + 1000
            assert code in (WS_RECONNECT_RANGE if reason.reconnect else WS_TERMINAL_RANGE)
    assert CloseReason.SLOW.ws_code == 4001
    assert CloseReason.PING_TIMEOUT.ws_code == 4006
    assert CloseReason.MESSAGE_TOO_BIG.ws_code == 1009


def test_commands_parse_with_request_ids() -> None:
    text = json.dumps({"type": "subscribe", "request_id": "a", "task_id": T1})
    assert parse_command(text) == Command("subscribe", "a", task_id=T1)
    assert parse_command('{"type":"subscribe","request_id":7}') == Command("subscribe", 7)
    assert parse_command('{"type":"unsubscribe","request_id":"b"}') == Command("unsubscribe", "b")
    assert parse_command('{"type":"resume","request_id":"c","after":"5-3"}') == Command(
        "resume", "c", after=Cursor(5, 3)
    )


@pytest.mark.parametrize(
    ("text", "request_id", "code"),
    [
        ("not json", None, "bad_command"),
        ("[1]", None, "bad_command"),
        ('{"type":"subscribe"}', None, "bad_command"),
        ('{"type":"cancel","request_id":"x","task_id":"t"}', "x", "unsupported_command"),
        ('{"type":"retry","request_id":"x"}', "x", "unsupported_command"),
        ('{"type":"subscribe","request_id":"x","task_id":"nope"}', "x", "bad_request"),
        ('{"type":"resume","request_id":"x","after":"zz"}', "x", "bad_request"),
        ('{"type":"resume","request_id":"x"}', "x", "bad_request"),
    ],
)
def test_bad_commands_are_named_errors(text: str, request_id: str | None, code: str) -> None:
    with pytest.raises(CommandError) as info:
        parse_command(text)
    assert (info.value.request_id, info.value.code) == (request_id, code)


def ws_head(*extra: str, path: str = "", version: str = "13", key: str = KEY) -> bytes:
    target = path or f"/v1/projects/{uuid.uuid4()}/ws"
    lines = [
        f"GET {target} HTTP/1.1",
        "Host: gw.example:8000",
        "Upgrade: websocket",
        "Connection: keep-alive, Upgrade",
        f"Sec-WebSocket-Version: {version}",
        f"Sec-WebSocket-Key: {key}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_parse_head_reads_a_websocket_upgrade() -> None:
    req = parse_head(ws_head("Origin: http://gw.example:8000", "Cookie: aivedio_stream_token=t"))
    assert req.websocket and req.ws_key == KEY
    assert req.origin == "http://gw.example:8000" and req.host == "gw.example:8000"
    assert req.token == "t" and req.token_from_cookie


def test_parse_head_refuses_bad_upgrades() -> None:
    with pytest.raises(UpgradeRequired) as info:
        parse_head(ws_head(version="8"))
    assert info.value.status == 426
    with pytest.raises(BadRequest):
        parse_head(ws_head(key="short"))
    pid = uuid.uuid4()
    with pytest.raises(BadRequest):
        parse_head(f"GET /v1/projects/{pid}/ws HTTP/1.1\r\nHost: x\r\n\r\n".encode())


@pytest.mark.parametrize(
    ("headers", "allowed", "ok"),
    [
        (["Origin: http://gw.example:8000"], (), True),  # same origin as Host
        (["Origin: http://evil.example"], (), False),
        (["Origin: https://app.example"], ("https://app.example",), True),
        (["Origin: http://gw.example:8000"], ("https://app.example",), False),
        (["Authorization: Bearer k"], (), True),  # no Origin: a server-side client with a key
        (["Cookie: aivedio_stream_token=t"], (), False),  # no Origin with the cookie: refused
        (["Cookie: aivedio_stream_token=t", "Authorization: Bearer k"], (), False),
    ],
)
def test_origin_allow_list(headers: list[str], allowed: tuple[str, ...], ok: bool) -> None:
    assert origin_allowed(parse_head(ws_head(*headers)), allowed) is ok
