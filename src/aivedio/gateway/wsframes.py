"""RFC 6455 on bytes (pure): the handshake answer, server frames, and parsing client frames.

Only what the gateway needs: text messages (JSON), ping/pong, close. No extension is ever
negotiated (no ``permessage-deflate``), so the reserved bits must be zero. Client frames must be
masked (RFC 6455 §5.1); server frames are not. A frame whose declared payload exceeds the cap is
refused from its header, before its payload is buffered.
"""

from __future__ import annotations

import base64
import hashlib
import struct

from aivedio.gateway.closecodes import CloseReason

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

RawFrame = tuple[bool, int, bytes]  # (fin, opcode, unmasked payload)


class Violation(Exception):
    """The client broke the protocol: close the connection with ``reason``."""

    def __init__(self, reason: CloseReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def accept_key(key: str) -> str:
    """``Sec-WebSocket-Accept`` for a client's ``Sec-WebSocket-Key``."""
    return base64.b64encode(
        hashlib.sha1(key.encode("ascii") + GUID, usedforsecurity=False).digest()
    ).decode("ascii")


def valid_key(key: str) -> bool:
    try:
        return len(base64.b64decode(key.encode("ascii"), validate=True)) == 16
    except (ValueError, UnicodeEncodeError):
        return False


def handshake_response(key: str) -> bytes:
    return (
        "HTTP/1.1 101 Switching Protocols\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        f"Sec-WebSocket-Accept: {accept_key(key)}\r\n"
        "\r\n"
    ).encode("ascii")


def encode(opcode: int, payload: bytes) -> bytes:
    """One unfragmented, unmasked server frame."""
    n = len(payload)
    if n < 126:
        header = bytes((0x80 | opcode, n))
    elif n < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return header + payload


def text(payload: bytes) -> bytes:
    return encode(OP_TEXT, payload)


def close(code: int, reason: str = "") -> bytes:
    return encode(OP_CLOSE, struct.pack("!H", code) + reason.encode()[:123])


PING = encode(OP_PING, b"")


def unmask(data: bytes, mask: bytes) -> bytes:
    n = len(data)
    if n == 0:
        return b""
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


def parse_frames(buffer: bytes, max_payload: int) -> tuple[list[RawFrame], int]:
    """The complete client frames at the start of ``buffer`` and how many bytes they used.

    Raises ``Violation`` for an unmasked frame, reserved bits, an unknown opcode, a fragmented or
    long control frame (``protocol_error``) and a payload over ``max_payload``
    (``message_too_big``, decided from the header alone).
    """
    frames: list[RawFrame] = []
    pos, end = 0, len(buffer)
    while end - pos >= 2:
        b0, b1 = buffer[pos], buffer[pos + 1]
        fin, opcode, length = bool(b0 & 0x80), b0 & 0x0F, b1 & 0x7F
        if b0 & 0x70:
            raise Violation(CloseReason.PROTOCOL_ERROR, "reserved bits set")
        if not b1 & 0x80:
            raise Violation(CloseReason.PROTOCOL_ERROR, "client frames must be masked")
        if opcode >= OP_CLOSE:
            if opcode > OP_PONG:
                raise Violation(CloseReason.PROTOCOL_ERROR, "unknown opcode")
            if not fin or length > 125:
                raise Violation(CloseReason.PROTOCOL_ERROR, "bad control frame")
        elif opcode > OP_BINARY:
            raise Violation(CloseReason.PROTOCOL_ERROR, "unknown opcode")
        at = pos + 2
        if length == 126:
            if end - at < 2:
                break
            length = int.from_bytes(buffer[at : at + 2], "big")
            at += 2
        elif length == 127:
            if end - at < 8:
                break
            length = int.from_bytes(buffer[at : at + 8], "big")
            at += 8
        if length > max_payload:
            raise Violation(CloseReason.MESSAGE_TOO_BIG, "frame over the size cap")
        if end - at < 4 + length:
            break
        mask = buffer[at : at + 4]
        frames.append((fin, opcode, unmask(buffer[at + 4 : at + 4 + length], mask)))
        pos = at + 4 + length
    return frames, pos


def close_code(payload: bytes) -> int:
    """The code in a client's close frame (1005: none given)."""
    if len(payload) == 1:
        raise Violation(CloseReason.PROTOCOL_ERROR, "bad close frame")
    return int.from_bytes(payload[:2], "big") if payload else 1005
