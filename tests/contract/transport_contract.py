"""The transport contract: what every ``Transport`` (``gateway/transport.py``) promises its session,
checked from the far end of a connection.

Subclass :class:`TransportContract` as ``Test<Adapter>Transport`` and provide the ``link``
fixture: a :class:`Link`, one open connection whose server side is the transport under test,
set up as the gateway leaves it once a client was admitted (its session is a
:class:`SessionRecorder`; SSE has written its response head, a WebSocket its 101), and whose
client side reads what arrives. Real adapters are linked over real sockets to real peers
(``tests/contract/transport_links.py``); the fake reads its own record.

The promises: the frames written (``frame_of`` of an event, by ``write`` or ``write_many``,
inside ``corked()`` or not) arrive in order and intact; ``close`` says its reason to the peer once
(a goodbye frame, or for an abrupt reason none) after every frame written before it, and writes
after it are dropped without an error; a peer that stops reading makes the transport unwritable
and the session is told, and when it reads again the transport is writable, the session is told,
and nothing was lost; a peer that goes away is noticed (the session is told once, writes are
dropped); a ping leaves a healthy peer's connection live. Every wait is bounded by
``tests/waiting.eventually``; nothing asserts how long something took.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import pytest

from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.frames import Event, make_event, ping_frame
from aivedio.gateway.transport import Transport, corked
from tests.waiting import eventually

TASK = str(uuid.uuid4())
MAX_FRAMES_UNTIL_FULL = 200_000  # a bound on the slow-reader test's writes, far above any buffer


class Seen(NamedTuple):
    """One task event as the peer read it."""

    seq: int
    task_id: str
    status: str
    error: str | None


def event(seq: int, error_size: int = 0) -> Event:
    """A task event; ``error_size`` makes its frame large (a long ``error`` text)."""
    text = (f"{seq}:" + "abcdefghijklmnopqrstuvwxyz" * (error_size // 26 + 1))[:error_size]
    public = {
        "task_id": TASK,
        "task_version": seq,
        "status": "running",
        "stage": "generating",
        "progress": seq % 100,
        "error": text or None,
    }
    return make_event(1, seq, public)


def seen(events: Sequence[Event]) -> list[Seen]:
    return [
        Seen(e.seq, e.task_id, str((e.data or {})["status"]), (e.data or {})["error"])
        for e in events
    ]


class SessionRecorder:
    """A transport's session (``SessionEvents``) that records what it was told."""

    def __init__(self) -> None:
        self.lost = 0
        self.paused = 0
        self.writable = 0
        self.closed: list[CloseReason] = []

    def on_lost(self) -> None:
        self.lost += 1

    def on_paused(self) -> None:
        self.paused += 1

    def on_writable(self) -> None:
        self.writable += 1

    def close(self, reason: CloseReason) -> None:
        self.closed.append(reason)


class Link(ABC):
    """One connection: ``transport`` (server side, under test), ``events`` (its session) and
    the peer's view."""

    transport: Transport
    events: SessionRecorder

    @abstractmethod
    def seen(self) -> list[Seen]:
        """The task events the peer read so far, in order."""

    @abstractmethod
    async def goodbye(self) -> CloseReason | None:
        """Wait for the end of the stream; the reason the peer was told (``None``: cut without a
        goodbye frame). Fails if a task event arrived after the goodbye."""

    @abstractmethod
    def stop_reading(self) -> None:
        """The peer stops reading (what arrives piles up in its socket, then in ours)."""

    @abstractmethod
    def resume_reading(self) -> None: ...

    @abstractmethod
    async def hang_up(self, abrupt: bool) -> None:
        """The peer goes away: a clean close (FIN, a WebSocket close frame) or a reset."""

    async def arrived(self, n: int) -> list[Seen]:
        """Wait until at least ``n`` task events arrived; all that arrived."""
        await eventually(lambda: len(self.seen()) >= n, f"{n} frames at the peer")
        return self.seen()

    def send(self, *events: Event) -> None:
        for e in events:
            self.transport.write(self.transport.frame_of(e))

    def send_many(self, *events: Event) -> None:
        self.transport.write_many([self.transport.frame_of(e) for e in events])


def parse_sse(data: bytes) -> tuple[list[Seen], list[tuple[int, str]], bool]:
    """(task events, close frames as (code, reason), whether a task event followed a close) of
    an SSE stream's bytes after the response head; comments, ``retry:`` and a trailing partial
    frame are skipped."""
    events: list[Seen] = []
    closes: list[tuple[int, str]] = []
    after_close = False
    for block in data.decode().split("\n\n")[:-1]:
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, sep, value = line.partition(": ")
            if sep and name in ("id", "event", "data"):
                fields[name] = value
        if fields.get("event") == "task.status":
            body = json.loads(fields["data"])
            assert fields["id"] == f"1-{body['event_id']}"
            after_close = after_close or bool(closes)
            events.append(Seen(body["event_id"], body["task_id"], body["status"], body["error"]))
        elif fields.get("event") == "close":
            body = json.loads(fields["data"])
            closes.append((body["code"], body["reason"]))
    return events, closes, after_close


class TransportContract:
    """Shared tests. Subclasses provide ``link``."""

    @pytest.fixture
    def link(self) -> Link:
        raise NotImplementedError

    # -- frames --------------------------------------------------------------------------

    async def test_frames_arrive_in_order_and_intact(self, link: Link) -> None:
        assert link.transport.writable and link.transport.kind
        events = [event(n, error_size=(70_000 if n == 7 else 50 * n)) for n in range(1, 41)]
        link.send(*events[:10])
        link.send_many(*events[10:30])
        link.send_many()  # nothing: harmless
        link.send(*events[30:])
        assert await link.arrived(40) == seen(events)

    async def test_frames_written_inside_a_cork_arrive_in_order(self, link: Link) -> None:
        events = [event(n) for n in range(1, 9)]
        link.send(events[0])
        with corked():
            link.send(*events[1:3])
            link.send_many(*events[3:5])
            with corked():  # a nested cork joins the outer one
                link.send(events[5])
            link.send(events[6])
        link.send(events[7])
        assert await link.arrived(8) == seen(events)

    # -- close ---------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "reason",
        [
            CloseReason.SHUTDOWN,
            CloseReason.SESSION_EXPIRED,
            CloseReason.CREDENTIAL_REVOKED,
            CloseReason.PROTOCOL_ERROR,
        ],
    )
    async def test_close_tells_the_peer_its_reason_after_every_frame(
        self, link: Link, reason: CloseReason
    ) -> None:
        events = [event(n) for n in range(1, 4)]
        link.send(*events)
        link.transport.close(reason)
        assert not link.transport.writable
        link.transport.close(CloseReason.SERVER_ERROR)  # a second close changes nothing
        assert await link.goodbye() is reason
        assert link.seen() == seen(events)
        assert link.events.lost == 0  # the server closed: the session is not told it lost

    @pytest.mark.parametrize("reason", [CloseReason.KILLED, CloseReason.CLIENT_GONE])
    async def test_an_abrupt_reason_cuts_without_a_goodbye(
        self, link: Link, reason: CloseReason
    ) -> None:
        link.transport.close(reason)
        assert not link.transport.writable
        assert await link.goodbye() is None

    async def test_a_close_inside_a_cork_comes_after_the_frames_it_held(self, link: Link) -> None:
        events = [event(n) for n in range(1, 4)]
        with corked():
            link.send(*events)
            link.transport.close(CloseReason.SHUTDOWN)
            link.send(event(4))  # after the close: dropped
        assert await link.goodbye() is CloseReason.SHUTDOWN
        assert link.seen() == seen(events)

    async def test_writes_after_close_are_dropped_without_an_error(self, link: Link) -> None:
        link.send(event(1))
        link.transport.close(CloseReason.SHUTDOWN)
        link.send(event(2))
        link.send_many(event(3), event(4))
        link.transport.ping(time.monotonic(), ping_frame(0))
        assert link.transport.overdue(time.monotonic()) is None
        assert await link.goodbye() is CloseReason.SHUTDOWN
        assert link.seen() == seen([event(1)])

    # -- flow control --------------------------------------------------------------------

    async def test_a_slow_reader_makes_it_unwritable_and_loses_nothing(self, link: Link) -> None:
        link.stop_reading()
        written: list[Event] = []
        while link.transport.writable and len(written) < MAX_FRAMES_UNTIL_FULL:
            written.append(event(len(written) + 1, error_size=2000))
            link.send(written[-1])
        assert not link.transport.writable, "the buffers never filled"
        assert link.events.paused == 1 and link.events.writable == 0
        link.resume_reading()
        await eventually(lambda: link.events.writable == 1, "the session told it is writable")
        assert link.transport.writable
        written.append(event(len(written) + 1))
        link.send(written[-1])
        assert await link.arrived(len(written)) == seen(written)

    # -- the peer ------------------------------------------------------------------------

    @pytest.mark.parametrize("abrupt", [False, True], ids=["clean", "reset"])
    async def test_a_peer_that_goes_away_is_noticed_once(self, link: Link, abrupt: bool) -> None:
        link.send(event(1))
        await link.arrived(1)
        await link.hang_up(abrupt)
        await eventually(lambda: link.events.lost == 1, "the session told the peer left")
        assert not link.transport.writable
        link.send(event(2))  # dropped, no error
        link.send_many(event(3))
        link.transport.close(CloseReason.SHUTDOWN)  # the session's late close: harmless
        assert link.events.lost == 1 and link.events.closed == []

    async def test_a_ping_leaves_a_healthy_peer_live(self, link: Link) -> None:
        now = time.monotonic()
        link.transport.ping(now, ping_frame(int(time.time())))
        link.send(event(1))
        assert await link.arrived(1) == seen([event(1)])
        await eventually(lambda: link.transport.overdue(now) is None, "the ping answered")
        assert link.transport.writable and link.events.lost == 0
