"""``ProjectStream``: a live seq that arrives before an earlier one waits ``reorder_wait_s`` for
it before reading PostgreSQL; a seq really lost is read from the store after the wait."""

from __future__ import annotations

import uuid

from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import Event, make_event
from aivedio.gateway.resume import ProjectStream
from aivedio.gateway.store import Position
from tests.waiting import eventually as until

EPOCH = 7


def event(seq: int) -> Event:
    public = {"task_id": "t1", "status": "running", "stage": "generating", "progress": seq}
    return make_event(EPOCH, seq, public)


class Store:
    """The stream's store: every event up to ``head``; counts the reads."""

    def __init__(self, head: int) -> None:
        self.head = head
        self.reads: list[tuple[int, int]] = []

    async def position(self, project_id: uuid.UUID) -> Position:
        return Position(EPOCH, 0, 0)

    async def events(
        self, project_id: uuid.UUID, epoch: int, after: int, upto: int, limit: int
    ) -> list[Event]:
        self.reads.append((after, upto))
        return [event(s) for s in range(after + 1, min(upto, after + limit) + 1)]


class Session:
    def __init__(self) -> None:
        self.seqs: list[int] = []

    def deliver(self, event: Event) -> None:
        self.seqs.append(event.seq)


async def stream_with(store: Store, wait_s: float) -> tuple[ProjectStream, Session]:
    config = GatewayConfig(redis_url="redis://unused", reorder_wait_s=wait_s)
    stream = ProjectStream(uuid.uuid4(), store, config)  # type: ignore[arg-type]
    session = Session()
    stream.sessions.add(session)  # type: ignore[arg-type]
    await stream.start()
    return stream, session


async def test_a_reordered_event_is_delivered_in_order_without_a_read() -> None:
    store = Store(head=3)
    stream, session = await stream_with(store, wait_s=5.0)
    for seq in (1, 3, 2):
        stream.on_live(EPOCH, event(seq))
    assert session.seqs == [1, 2, 3]
    assert store.reads == []
    assert stream._reorder is None  # nothing left waiting
    stream.close()


async def test_a_lost_event_is_read_after_the_wait() -> None:
    store = Store(head=3)
    stream, session = await stream_with(store, wait_s=0.05)
    stream.on_live(EPOCH, event(1))
    stream.on_live(EPOCH, event(3))  # 2 never comes live
    assert session.seqs == [1]
    await until(lambda: session.seqs == [1, 2, 3])
    assert store.reads == [(1, 2)]
    stream.close()


async def test_no_wait_reads_at_once() -> None:
    store = Store(head=3)
    stream, session = await stream_with(store, wait_s=0.0)
    stream.on_live(EPOCH, event(1))
    stream.on_live(EPOCH, event(3))
    await until(lambda: session.seqs == [1, 2, 3])
    assert store.reads == [(1, 2)]
    stream.close()
