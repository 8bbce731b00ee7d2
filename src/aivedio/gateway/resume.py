"""Per-project ordering on this node, gap repair, and the exact resume of one session.

``ProjectStream`` is the node's view of one project's event stream: it delivers events to its
sessions strictly in seq order, each exactly once. A live event whose seq is not ``last + 1`` is
held while the missing range is read from PostgreSQL (gap repair); seqs are contiguous and
commit-ordered (docs/explanation/cursors.md), so a gap is always a lost message, never a hole.

``resume`` brings one new session from its cursor to live: the session is subscribed FIRST (its
stream buffers live events for it), then the range ``(cursor, last]`` is replayed from PostgreSQL
in pages, then the buffer is merged by seq and the session is live.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aivedio.gateway import frames, metrics
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import Event
from aivedio.gateway.protocol import Cursor
from aivedio.gateway.session import Session
from aivedio.gateway.store import EventStore, Position
from aivedio.logs import log

logger = logging.getLogger("aivedio.gateway")

PENDING_MAX = 5000  # out-of-order live events held per project; beyond, they are re-read


class ProjectStream:
    def __init__(self, project_id: uuid.UUID, store: EventStore, config: GatewayConfig) -> None:
        self.project_id = project_id
        self.store = store
        self.config = config
        self.epoch = 0
        self.last = 0  # the last seq delivered to this node's sessions
        self.sessions: set[Session] = set()
        self.joining = 0
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._early: list[tuple[int, Event]] = []  # live events that arrived before the start
        self._pending: dict[int, Event] = {}
        self._target = 0
        self._repair: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._reorder: asyncio.TimerHandle | None = None  # a gap waiting for its late event

    async def start(self) -> None:
        """Take the position from PostgreSQL; live events seen meanwhile are ordered after it."""
        try:
            position = await self.store.position(self.project_id)
            if position is None:
                raise LookupError(f"project {self.project_id} has no event stream")
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.ready.exception()  # retrieved here; joiners re-raise it
            raise
        self.epoch, self.last = position.epoch, position.head
        self.ready.set_result(None)
        early, self._early = self._early, []
        for epoch, event in sorted(early, key=lambda item: item[1].seq):
            self.on_live(epoch, event)

    # -- live ------------------------------------------------------------------------------

    def on_live(self, epoch: int, event: Event) -> None:
        if not self.ready.done():
            self._early.append((epoch, event))
            return
        if epoch != self.epoch or event.seq <= self.last:
            return  # a duplicate, or another history (the tail check rebases on the stream row)
        if event.seq == self.last + 1 and self._repair is None:
            self._dispatch(event, "live")
            self._drain()
            return
        if len(self._pending) < PENDING_MAX:
            self._pending[event.seq] = event
        elif self._reorder is not None:  # too far behind to wait: read it now
            self._gap_persists()
            return
        wait = self.config.reorder_wait_s
        if self._repair is not None or wait <= 0:
            self._gap_persists()
        elif self._reorder is None:
            # Several relays and dispatchers publish one project's events side by side, so a
            # later seq often arrives a few ms before an earlier one: wait for it briefly before
            # reading PostgreSQL. With two run --role all processes, 10-16 % of the frames were
            # re-read (bench e2e); a message really lost costs reorder_wait_s more.
            self._reorder = asyncio.get_running_loop().call_later(wait, self._gap_persists)

    def _gap_persists(self) -> None:
        """The missing seqs did not arrive live: read them from PostgreSQL."""
        if self._reorder is not None:
            self._reorder.cancel()
            self._reorder = None
        if not self._pending:
            return
        if self._repair is None:
            metrics.GAP_REPAIRS.inc()
        self.repair(min(self._pending) - 1)

    def _dispatch(self, event: Event, source: str) -> None:
        self.last = event.seq
        metrics.EVENTS.labels(source).inc()
        metrics.FRAMES.inc(len(self.sessions))  # one per session (filtered ones included)
        for session in tuple(self.sessions):
            session.deliver(event)
        if event.stored_at is not None and self.sessions:  # once per event and node
            age = metrics.EVENT_AGE_BY_SOURCE.get(source) or metrics.EVENT_AGE.labels(source)
            age.observe(max(0.0, time.time() - event.stored_at))
        if logger.isEnabledFor(logging.DEBUG):
            log(
                logger,
                logging.DEBUG,
                "frame written",
                trace_id=event.trace_id,
                project_id=str(self.project_id),
                task_id=event.task_id,
                seq=event.seq,
                source=source,
                sessions=len(self.sessions),
            )

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            event = pending.pop(self.last + 1, None)
            if event is None:
                break
            self._dispatch(event, "live")
        if pending and min(pending) <= self.last:
            for seq in [s for s in pending if s <= self.last]:
                del pending[seq]
        if not pending and self._reorder is not None:  # the late events came: no repair
            self._reorder.cancel()
            self._reorder = None

    # -- repair ----------------------------------------------------------------------------

    def repair(self, upto: int) -> None:
        """Read ``(last, upto]`` from PostgreSQL and deliver it (one repair at a time)."""
        if upto <= self.last:
            return
        self._target = max(self._target, upto)
        if self._repair is None and self.ready.done():
            self._repair = asyncio.create_task(self._run_repair())

    def repair_if_behind(self, head: int) -> None:
        if head > self.last:
            metrics.TAIL_REPAIRS.inc()
            self.repair(head)

    async def _run_repair(self) -> None:
        failed = False
        try:
            while self.last < self._target:
                events = await self.store.events(
                    self.project_id, self.epoch, self.last, self._target, self.config.replay_page
                )
                if not events or events[0].seq != self.last + 1:
                    # Rows gone (retention floor moved past them): the sessions re-read snapshots.
                    self._skip_to(self._target, "below_floor")
                    break
                for event in events:
                    if event.seq == self.last + 1:
                        self._dispatch(event, "repair")
                        self._drain()
        except Exception as exc:
            failed = True
            log(
                logger,
                logging.WARNING,
                "gap repair failed",
                project_id=str(self.project_id),
                error=repr(exc),
            )
        finally:
            self._repair = None
        self._drain()
        if failed:
            if self._retry is None:
                self._retry = asyncio.get_running_loop().call_later(1.0, self._retry_repair)
        elif self._pending:
            self.repair(min(self._pending) - 1)

    def _retry_repair(self) -> None:
        self._retry = None
        self.repair(self._target)

    def _skip_to(self, seq: int, reason: str) -> None:
        self.last = seq
        self._reset_sessions(reason)

    def rebase(self, position: Position) -> None:
        """The stream row has another epoch (re-created): every session starts over."""
        self.epoch, self.last, self._target = position.epoch, position.head, position.head
        self._pending.clear()
        self._reset_sessions("other_epoch")

    def _reset_sessions(self, reason: str) -> None:
        frame = frames.reset_event(self.epoch, self.last, reason)
        for session in tuple(self.sessions):
            metrics.RESETS.labels(reason).inc()
            session.sent = self.last
            if session.backlog is not None:
                session.backlog = [frame]  # written by go_live, in order
            else:
                session.write_control(frame)

    def close(self) -> None:
        if self._repair is not None:
            self._repair.cancel()
        if self._retry is not None:
            self._retry.cancel()
        if self._reorder is not None:
            self._reorder.cancel()


def reset_reason(cursor: Cursor, position: Position, cap: int) -> str | None:
    """Why a cursor cannot be replayed exactly (``None``: it can)."""
    if cursor.epoch != position.epoch:
        return "other_epoch"
    if cursor.seq > position.head:
        return "ahead_of_head"
    if cursor.seq < position.floor:
        return "below_floor"
    if position.head - cursor.seq > cap:
        return "replay_too_large"
    return None


async def resume(
    session: Session,
    stream: ProjectStream,
    cursor: Cursor | None,
    position: Position,
    joined_at: int,
    store: EventStore,
    config: GatewayConfig,
) -> None:
    """Replay ``(cursor, joined_at]`` (``joined_at``: the stream's ``last`` when the session
    joined; everything after it is in the session's backlog), then go live."""
    if cursor is None:
        session.sent = position.head
        session.write_control(frames.start_event(position.epoch, position.head))
    else:
        reason = reset_reason(cursor, position, config.replay_cap)
        if reason is None:
            session.sent = cursor.seq
        else:
            metrics.RESETS.labels(reason).inc()
            session.sent = position.head
            session.write_control(frames.reset_event(position.epoch, position.head, reason))
    if position.head > stream.last:
        stream.repair(position.head)  # this node is behind the stream: catch up now
    while session.sent < joined_at and session.closed is None:
        page = await store.events(
            session.project_id, position.epoch, session.sent, joined_at, config.replay_page
        )
        if not page or any(e.seq != session.sent + 1 + i for i, e in enumerate(page)):
            # Rows of (sent, joined_at] are gone: retention raised the floor and dropped them
            # after the position was read. Never a silent partial replay: the session resets.
            metrics.RESETS.labels("below_floor").inc()
            session.sent = joined_at
            session.write_control(frames.reset_event(position.epoch, joined_at, "below_floor"))
            break
        session.replay(page)
    session.go_live()
