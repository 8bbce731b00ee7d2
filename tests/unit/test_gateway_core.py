"""Pure gateway logic without sockets: queue coalescing, head parsing, tokens, resets, sessions."""

from __future__ import annotations

import json
import uuid
from typing import Any, cast

import pytest

from aivedio.gateway.auth import Refused, StreamTokens
from aivedio.gateway.closecodes import RECONNECT_RANGE, TERMINAL_RANGE, CloseReason
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import Event, make_event
from aivedio.gateway.hub import Hub
from aivedio.gateway.protocol import BadRequest, Cursor, parse_head
from aivedio.gateway.queue import PendingQueue
from aivedio.gateway.resume import reset_reason
from aivedio.gateway.session import Identity, Session
from aivedio.gateway.store import Position
from tests.fakes.transport import RecordingTransport

T1, T2 = str(uuid.uuid4()), str(uuid.uuid4())


def ev(seq: int, task: str = T1, status: str = "running", stage: str = "generating") -> Event:
    return make_event(
        7,
        seq,
        {"task_id": task, "task_version": seq, "status": status, "stage": stage, "progress": seq},
    )


def test_progress_coalesces_but_changes_and_finals_stay() -> None:
    q = PendingQueue(100, 1 << 20)
    for seq in (1, 2, 3):
        q.push(ev(seq))
    q.push(ev(4, T2))
    q.push(ev(5, status="processing_media", stage="ingesting"))
    q.push(ev(6, status="ready", stage="done"))
    q.push(ev(7, status="ready", stage="done"))
    assert [e.seq for e in q.take()] == [3, 4, 5, 6, 7]


def test_queue_reports_overflow() -> None:
    q = PendingQueue(2, 1 << 20)
    assert q.push(ev(1, status="ready", stage="done"))
    assert q.push(ev(2, T2, status="ready", stage="done"))
    assert not q.push(ev(3, status="failed", stage="done"))


def test_frame_is_the_public_contract_and_drops_private_fields() -> None:
    event = make_event(
        5,
        9,
        {
            "task_id": T1,
            "task_version": 2,
            "status": "running",
            "stage": "generating",
            "progress": 5,
            "cost": 3,
            "url": "s3://x",
        },
    )
    text = event.frame.decode()
    assert text.startswith("id: 5-9\nevent: task.status\ndata: {")
    assert text.endswith("}\n\n")
    assert "cost" not in text and "s3://" not in text
    assert '"event_id":9' in text


def head(target: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {target} HTTP/1.1", "Host: x", *headers]) + "\r\n\r\n").encode()


def test_parse_head_reads_cursor_filter_and_credentials() -> None:
    pid = uuid.uuid4()
    req = parse_head(
        head(
            f"/v1/projects/{pid}/events?task_id={T1}&token=abc",
            "Last-Event-ID: 5-3",
            "Authorization: Bearer k1",
        )
    )
    assert req.project_id == pid
    assert req.cursor == Cursor(5, 3)
    assert req.task_id == T1 and req.token == "abc" and req.bearer == "k1"
    assert parse_head(
        head(f"/v1/projects/{pid}/events?after=9-1", "Last-Event-ID: 5-3")
    ).cursor == Cursor(9, 1)
    cookie = parse_head(head(f"/v1/projects/{pid}/events", "Cookie: a=b; aivedio_stream_token=t"))
    assert cookie.token == "t"


@pytest.mark.parametrize("target", ["/v1/projects/nope/events", "/v1/projects/x/events?after=z"])
def test_parse_head_rejects(target: str) -> None:
    with pytest.raises(BadRequest):
        parse_head(head(target))


def test_stream_tokens_round_trip_expire_and_resist_forgery() -> None:
    tokens = StreamTokens(b"s" * 32)
    ids = [uuid.uuid4() for _ in range(4)]
    token, expires = tokens.mint(*ids, now=1000.0)
    assert expires == 1060
    assert tokens.verify(token, now=1059).project_id == ids[2]
    with pytest.raises(Refused) as expired:
        tokens.verify(token, now=1060)
    assert expired.value.reason is CloseReason.CREDENTIAL_EXPIRED
    body, _, sig = token.partition(".")
    with pytest.raises(Refused):
        tokens.verify(body[:-2] + "AA." + sig, now=1000)


def test_reset_reasons() -> None:
    pos = Position(epoch=7, head=100, floor=10)
    assert reset_reason(Cursor(8, 50), pos, 1000) == "other_epoch"
    assert reset_reason(Cursor(7, 101), pos, 1000) == "ahead_of_head"
    assert reset_reason(Cursor(7, 9), pos, 1000) == "below_floor"
    assert reset_reason(Cursor(7, 50), pos, 49) == "replay_too_large"
    assert reset_reason(Cursor(7, 50), pos, 50) is None


def test_close_codes_are_in_their_ranges() -> None:
    for reason in CloseReason:
        assert reason.code in (RECONNECT_RANGE if reason.reconnect else TERMINAL_RANGE)
    assert len({r.code for r in CloseReason}) == len(CloseReason)


class Owner:
    def __init__(self) -> None:
        self.forgotten: list[CloseReason] = []

    def forget(self, session: Session, reason: CloseReason) -> None:
        self.forgotten.append(reason)


def session(transport: RecordingTransport, owner: Owner, **kw: object) -> Session:
    config = GatewayConfig(redis_url="redis://unused", queue_max_events=3)
    ident = Identity(uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    return Session(
        transport,
        owner,
        config,
        uuid.uuid4(),
        ident,
        kw.get("task_filter"),  # type: ignore[arg-type]
        expires_at=1e18,
    )


def test_replay_then_backlog_merge_without_duplicates() -> None:
    transport, owner = RecordingTransport(), Owner()
    s = session(transport, owner)
    s.sent = 2
    s.deliver(ev(5))  # live, while replaying: buffered
    s.deliver(ev(6))
    s.replay([ev(3), ev(4), ev(5)])
    s.go_live()
    s.deliver(ev(6))  # duplicate
    s.deliver(ev(7))
    assert transport.frames == [ev(n).frame for n in (3, 4, 5, 6, 7)]


def test_filter_advances_the_cursor_without_writing() -> None:
    transport, owner = RecordingTransport(), Owner()
    s = session(transport, owner, task_filter=T2)
    s.go_live()
    s.deliver(ev(1))
    s.deliver(ev(2, T2))
    assert s.sent == 2
    assert transport.frames == [ev(2, T2).frame]


def test_unwritable_session_queues_then_evicts_as_slow() -> None:
    transport, owner = RecordingTransport(), Owner()
    s = session(transport, owner)
    s.go_live()
    transport.writable = False
    for n in range(1, 4):
        s.deliver(ev(n, T1 if n % 2 else T2, status="ready", stage="done"))
    assert transport.frames == [] and s.closed is None
    transport.writable = True
    s.on_writable()
    assert len(transport.frames) == 3
    transport.writable = False
    for n in range(4, 9):
        s.deliver(ev(n, status="ready", stage="done"))
    assert transport.closed is CloseReason.SLOW
    assert owner.forgotten == [CloseReason.SLOW]
    s.deliver(ev(9))
    assert transport.refused == []  # a closed session writes nothing more


def test_the_socket_events_of_the_fake_reach_the_session() -> None:
    transport, owner = RecordingTransport(), Owner()
    s = session(transport, owner)
    transport.session = s
    s.go_live()
    transport.stall()
    s.deliver(ev(1))
    assert transport.frames == [] and s.paused_at is not None
    transport.drain()
    assert transport.frames == [ev(1).frame] and s.paused_at is None
    transport.hang_up()
    assert s.closed is CloseReason.CLIENT_GONE
    assert owner.forgotten == [CloseReason.CLIENT_GONE]
    s.deliver(ev(2))
    assert transport.frames == [ev(1).frame] and transport.refused == []


class _Stream:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def on_live(self, epoch: int, event: Event) -> None:
        self.events.append(event)


@pytest.mark.parametrize("timing", [False, True])
def test_timing_comment_only_when_asked_and_only_numbers(timing: bool) -> None:
    """AIVEDIO_GATEWAY_TIMING (off by default): the frame gains ``: timing <relayed>
    <dispatched> <written>`` and nothing else; the data line stays the public contract."""
    config = GatewayConfig(redis_url="redis://unused", timing=timing)
    assert GatewayConfig(redis_url="redis://unused").timing is False
    hub = Hub(cast(Any, None), cast(Any, None), config)
    project = uuid.uuid4()
    stream = _Stream()
    hub.streams[project] = cast(Any, stream)
    message = {
        "type": "task.status",
        "project_id": str(project),
        "epoch": 3,
        "seq": 4,
        "task_id": T1,
        "task_version": 2,
        "public": {"task_id": T1, "task_version": 2, "status": "running", "progress": 5},
        "relayed_at": 1767225600.25,
        "dispatched_at": 1767225600.5,
    }
    hub.on_message(json.dumps(message))
    hub.on_message(json.dumps(message | {"seq": 5, "relayed_at": None}))
    first, second = (e.frame.decode() for e in stream.events)
    data = first.split("\n")[2]
    assert data.startswith("data: {") and "1767225600" not in data
    if not timing:
        assert first.endswith("}\n\n") and ": timing" not in first
        return
    comment = first.split("\n")[3]
    _, word, relayed, dispatched, written = comment.split(" ")
    assert (word, relayed, dispatched) == ("timing", "1767225600.250000", "1767225600.500000")
    assert float(written) > 1767225600
    assert first.endswith("\n\n")
    assert second.split("\n")[3].startswith(": timing - 1767225600.500000 ")
