"""The gateway's RFC 6455 frame parser (``gateway/wsframes.py``) checked against wsproto as a peer.

Hypothesis plans a client's frames: text messages whole or in fragments, pings and pongs between
the fragments, a close with a code and a reason. wsproto's client encodes them (masked, with its
own choice of length encodings); wsproto's server and ``parse_frames`` both read the bytes, the
latter in arbitrary pieces as they arrive on a socket, and both must give back the plan. Frames
wsproto's server refuses (reserved bits, unmasked) ``parse_frames`` must refuse too.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.frame_protocol import CloseReason, FrameProtocol, Opcode, ParseFailed

from aivedio.gateway import wsframes

CAP = 1 << 20

texts = st.text(max_size=300)
controls = st.tuples(st.sampled_from(["ping", "pong"]), st.binary(max_size=125))
messages = st.one_of(
    st.tuples(st.just("text"), st.lists(texts, min_size=1, max_size=4)),  # fragments
    controls,
)
plans = st.tuples(
    st.lists(st.tuples(messages, st.lists(controls, max_size=2)), max_size=5),
    st.one_of(st.none(), st.tuples(st.sampled_from([1000, 1001, 3000, 4999]), texts)),
)


def encode(
    plan: tuple[list, tuple[int, str] | None],
) -> tuple[bytes, list[tuple[bool, int, bytes]]]:
    """The client's bytes and the frames ``parse_frames`` should give back."""
    client = FrameProtocol(client=True, extensions=[])
    out, expected = [], []
    steps, closing = plan
    for message, between in steps:
        if message[0] == "text":
            fragments = message[1]
            for i, fragment in enumerate(fragments):
                last = i == len(fragments) - 1
                out.append(client.send_data(fragment, fin=last))
                expected.append((last, wsframes.OP_TEXT if i == 0 else 0, fragment.encode()))
                if not last:  # control frames may come between the fragments of a message
                    for kind, payload in between:
                        out.append(_control(client, kind, payload))
                        expected.append((True, _opcode(kind), payload))
        else:
            out.append(_control(client, *message))
            expected.append((True, _opcode(message[0]), message[1]))
    if closing is not None:
        code, reason = closing
        reason = reason.encode()[:100].decode(errors="ignore")
        out.append(client.close(code, reason))
        expected.append((True, wsframes.OP_CLOSE, code.to_bytes(2, "big") + reason.encode()))
    return b"".join(out), expected


def _control(client: FrameProtocol, kind: str, payload: bytes) -> bytes:
    return client.ping(payload) if kind == "ping" else client.pong(payload)


def _opcode(kind: str) -> int:
    return wsframes.OP_PING if kind == "ping" else wsframes.OP_PONG


def parse_in_pieces(data: bytes, cuts: list[int]) -> list[tuple[bool, int, bytes]]:
    """What the transport does: append what arrived, parse, keep what was not used."""
    frames: list[tuple[bool, int, bytes]] = []
    buffer, at = b"", 0
    for cut in [*sorted(cuts), len(data)]:
        buffer += data[at:cut]
        at = max(at, cut)
        parsed, used = wsframes.parse_frames(buffer, CAP)
        frames += parsed
        buffer = buffer[used:]
    assert buffer == b""
    return frames


def wsproto_reads(data: bytes) -> list[tuple[bool, int, bytes]]:
    server = FrameProtocol(client=False, extensions=[])
    server.receive_bytes(data)
    frames, open_message = [], False
    for frame in server.received_frames():
        assert frame.frame_finished
        if frame.opcode is Opcode.CLOSE:
            code, reason = frame.payload
            payload = int(code).to_bytes(2, "big") + reason.encode()
            frames.append((True, wsframes.OP_CLOSE, payload))
        elif frame.opcode in (Opcode.PING, Opcode.PONG):
            frames.append((True, int(frame.opcode), bytes(frame.payload)))
        else:
            opcode = 0 if open_message else int(frame.opcode)
            frames.append((frame.message_finished, opcode, frame.payload.encode()))
            open_message = not frame.message_finished
    return frames


@settings(max_examples=300, deadline=None)
@given(plans, st.lists(st.integers(0, 4000), max_size=8))
def test_parse_frames_reads_what_wsproto_reads(plan: tuple, cuts: list[int]) -> None:
    data, expected = encode(plan)
    assert wsproto_reads(data) == expected  # the peer agrees with the plan
    assert parse_in_pieces(data, cuts) == expected


@given(texts, st.sampled_from(["reserved", "unmasked"]))
def test_frames_wsproto_refuses_are_refused(text: str, fault: str) -> None:
    if fault == "reserved":
        frame = bytearray(FrameProtocol(client=True, extensions=[]).send_data(text, fin=True))
        frame[0] |= 0x40  # RSV1 without a negotiated extension
        data = bytes(frame)
    else:  # a server's frame, sent by a client
        data = FrameProtocol(client=False, extensions=[]).send_data(text, fin=True)
    server = FrameProtocol(client=False, extensions=[])
    server.receive_bytes(data)
    with pytest.raises(ParseFailed) as refused:
        list(server.received_frames())
    assert refused.value.code is CloseReason.PROTOCOL_ERROR
    with pytest.raises(wsframes.Violation):
        wsframes.parse_frames(data, CAP)
