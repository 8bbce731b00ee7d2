"""One subscriber's stream logic, independent of the transport (SSE or WebSocket).

A session holds its cursor (``sent``: the last seq written or deliberately skipped), an optional
task filter, a backlog of live events while it replays from PostgreSQL, and a pending queue only
while its socket is not writable. It never awaits: the hub calls ``deliver`` synchronously for
every event of the project, in seq order, and a stalled session cannot delay the others.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from aivedio.gateway import metrics
from aivedio.gateway.closecodes import CloseReason
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.frames import Event
from aivedio.gateway.queue import PendingQueue
from aivedio.gateway.transport import Transport
from aivedio.logs import log

logger = logging.getLogger("aivedio.gateway")


@dataclass(frozen=True, slots=True)
class Identity:
    """Who is connected, and with which credential (checked again for revocation)."""

    tenant_id: uuid.UUID
    user_id: uuid.UUID
    key_id: uuid.UUID  # the API key (of the session, if a browser session opened it)
    session_id: uuid.UUID | None = None  # the browser session (cookie, or the token it minted)
    expires_at: float | None = None  # unix seconds: the credential's expiry caps the connection

    @property
    def credential_id(self) -> uuid.UUID:
        """What a revocation names: the session if there is one (revoking its key revokes it
        too), else the API key."""
        return self.session_id if self.session_id is not None else self.key_id


class Owner(Protocol):
    def forget(self, session: Session, reason: CloseReason) -> None: ...


NOTHING = ""  # a task filter no event matches (a WebSocket client unsubscribed)


class Session:
    __slots__ = (
        "backlog",
        "closed",
        "config",
        "expires_at",
        "identity",
        "opened_at",
        "owner",
        "paused_at",
        "pending",
        "project_id",
        "sent",
        "task_filter",
        "transport",
    )

    def __init__(
        self,
        transport: Transport,
        owner: Owner,
        config: GatewayConfig,
        project_id: uuid.UUID,
        identity: Identity,
        task_filter: str | None,
        expires_at: float,
    ) -> None:
        self.transport = transport
        self.owner = owner
        self.config = config
        self.project_id = project_id
        self.identity = identity
        self.task_filter = task_filter
        self.expires_at = expires_at  # monotonic
        self.opened_at = time.monotonic()
        self.sent = 0  # the cursor; with ``task_filter == NOTHING`` no task event is written
        self.backlog: list[Event] | None = []  # live events arriving while replaying
        self.pending: PendingQueue | None = None
        self.paused_at: float | None = None
        self.closed: CloseReason | None = None

    # -- live path (hub) -------------------------------------------------------------------

    def deliver(self, event: Event) -> None:
        """The next event of the project, in seq order."""
        if self.closed is not None:
            return
        if self.backlog is not None:
            self.backlog.append(event)
            if len(self.backlog) > self.config.backlog_max_events:
                self.close(CloseReason.SLOW)
            return
        if event.seq == 0:  # a control frame (reset) placed in the sequence
            self._send(event)
            return
        if event.seq <= self.sent:
            return  # already replayed
        self.sent = event.seq
        if self.task_filter is not None and event.task_id != self.task_filter:
            return  # the cursor advances; the frame is not written
        self._send(event)

    def _send(self, event: Event) -> None:
        if self.pending is None and self.transport.writable:
            self.transport.write(self.transport.frame_of(event))
            return
        if self.pending is None:
            self.pending = PendingQueue(self.config.queue_max_events, self.config.queue_max_bytes)
        if not self.pending.push(event):
            self.close(CloseReason.SLOW)

    def write_control(self, event: Event) -> None:
        """A frame outside the event sequence (``reset``, ``start``, a command reply), kept in
        order with events."""
        if self.closed is None:
            self._send(event)

    # -- resume (resume.py) ----------------------------------------------------------------

    def replay(self, events: Iterable[Event]) -> None:
        """Write a page of replayed events (bounded by the replay cap; written as one batch)."""
        out: list[bytes] = []
        written: list[Event] | None = [] if logger.isEnabledFor(logging.DEBUG) else None
        for event in events:
            if event.seq <= self.sent:
                continue
            self.sent = event.seq
            if self.task_filter is None or event.task_id == self.task_filter:
                out.append(self.transport.frame_of(event))
                if written is not None:
                    written.append(event)
        if out and self.closed is None:
            self.transport.write_many(out)
            metrics.FRAMES.inc(len(out))
            if written is not None:  # the trace ids of the replayed frames
                log(
                    logger,
                    logging.DEBUG,
                    "frames replayed",
                    project_id=str(self.project_id),
                    frames=[
                        {"task_id": e.task_id, "seq": e.seq, "trace_id": e.trace_id}
                        for e in written
                    ],
                )

    def go_live(self) -> None:
        """Replay done: deliver what arrived meanwhile (merge by seq), then live."""
        backlog, self.backlog = self.backlog, None
        for event in backlog or ():
            self.deliver(event)

    # -- transport callbacks -----------------------------------------------------------------

    def on_paused(self) -> None:
        self.paused_at = time.monotonic()

    def on_writable(self) -> None:
        self.paused_at = None
        pending, self.pending = self.pending, None
        if pending is not None and self.closed is None:
            self.transport.write_many([self.transport.frame_of(e) for e in pending.take()])

    def on_lost(self) -> None:
        if self.closed is None:
            self.closed = CloseReason.CLIENT_GONE
            self.owner.forget(self, CloseReason.CLIENT_GONE)

    # -- timers (the shared wheel) ---------------------------------------------------------

    def tick(self, now: float, ping: bytes) -> None:
        if self.closed is not None:
            return
        if now >= self.expires_at:
            self.close(CloseReason.SESSION_EXPIRED)
        elif self.paused_at is not None and now - self.paused_at > self.config.stall_timeout_s:
            self.close(CloseReason.SLOW)
        elif self.paused_at is None and (late := self.transport.overdue(now)) is not None:
            self.close(late)  # while congested, the stall deadline above decides (``slow``)
        elif self.pending is None and self.backlog is None and self.transport.writable:
            self.transport.ping(now, ping)

    def close(self, reason: CloseReason) -> None:
        if self.closed is not None:
            return
        self.closed = reason
        self.pending = None
        self.backlog = None
        self.transport.close(reason)
        self.owner.forget(self, reason)
